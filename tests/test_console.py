"""What a user's console shows, read from real subprocesses (pytest's own capture would hide the
``warnings`` module and third-party loggers): no third-party progress bars, deprecation warnings
or log lines between the answer or the one ``error:`` line and the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.adapter_helpers import small_adapter

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path), "PYTHONWARNINGS": "default"}


def _cli(tmp_path: Path, *args, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nxd_finetune", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=_env(tmp_path), cwd=tmp_path, timeout=600)


def test_generate_and_chat_print_the_answer_only(quickstart_cache, tmp_path):
    """Before: transformers' "Loading weights" bar and PEFT's FutureWarning about
    ``is_gradient_checkpointing`` on stderr."""
    adapter = small_adapter(tmp_path / "adapter")
    done = _cli(tmp_path, "generate", "--adapter", adapter, "--prompt", "Is 4 even?", "--max-new-tokens", "3",
                "--device", "cpu")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    done = _cli(tmp_path, "generate", "--base", "builtin:tiny-llama", "--prompt", "Is 4 even?", "--max-new-tokens",
                "3", "--device", "cpu")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    done = _cli(tmp_path, "chat", "--adapter", adapter, "--max-new-tokens", "3", "--device", "cpu",
                stdin="Is 4 even?\n/exit\n")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_over_long_rows_end_in_the_error_line_alone(quickstart_cache, tmp_path):
    """Rows past the tokenizer's model_max_length (1024) are ours to truncate: transformers'
    "Token indices sequence length is longer..." line is not printed (before: above the error)."""
    row = {"messages": [{"role": "user", "content": "Is 2 even? " * 600}, {"role": "assistant", "content": "even"}]}
    data = tmp_path / "long.jsonl"
    data.write_text((json.dumps(row) + "\n") * 4)
    done = _cli(tmp_path, "validate", QUICKSTART, f"data.train={data}", "data.eval=null", "eval.every_n_steps=null",
                f"data.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["error: no training samples left: all 4 rows have no trainable token within "
                                        "max_seq_len=128"], done.stderr


def test_num_proc_beyond_the_cores_is_capped_with_one_line(quickstart_cache, tmp_path):
    """data.num_proc=100000 forked a process per row; now at most one per core, said once."""
    cores = len(os.sched_getaffinity(0))
    done = _cli(tmp_path, "validate", QUICKSTART, "data.num_proc=100000", f"data.cache_dir={tmp_path / 'cache'}")
    assert done.returncode == 0, done.stderr
    notes = [ln for ln in done.stderr.splitlines() if "num_proc" in ln]
    assert notes == [f"warning: data.num_proc=100000 is more than the {cores} core(s) this process may use; "
                     f"tokenizing with {cores}"], done.stderr


@pytest.mark.usefixtures("quickstart_cache")
def test_the_lightning_example_on_two_ranks_has_no_lightning_noise(tmp_path):
    """Before: Lightning's 14-line warning about ModelCheckpoint under manual optimization (with
    sample code) and a progress bar titled ``Epoch 0/-2``."""
    out = tmp_path / "lt"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_quickstart.py"), "--devices", "2",
                           "--tp", "2", "--max-steps", "2", "--checkpoint-every", "1", "--out", str(out)],
                          capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    assert "manual optimization" not in console and "saved_models" not in console, console[-3000:]
    assert "Epoch 0/-" not in console, console[-3000:]
    assert (out / "checkpoints" / "step-00000002").is_dir() and (out / "final" / "adapter_config.json").is_file()

"""The after-training commands the README and docs/after-training.md show, run as written.

A shortened quickstart trains ``outputs/quickstart/final`` in a scratch directory (the relative
paths the docs use), then every ``generate`` / ``chat`` / ``eval`` line of those pages that reads
that adapter or the quickstart recipe runs verbatim (its ``# ...`` comment dropped).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "after-training.md")
SHORT = ["data.max_seq_len=64", "training.max_steps=4", "training.micro_batch_size=4", "training.warmup_steps=1",
         "logging.progress=false", "eval.before=false", "eval.every_n_steps=null"]
# the lines that need only the quickstart's adapter and recipe (registry and chat-file lines are run elsewhere)
WANTED = re.compile(r"^nxd-finetune (generate|chat) --adapter outputs/quickstart/final\b"
                    r"|^nxd-finetune eval recipes/quickstart\.yaml\b")


def doc_commands() -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.splitlines():
                if WANTED.match(line.strip()) and line.strip() not in {w.split(": ", 1)[1] for w, _ in found}:
                    found.append((f"{page.name}: {line.strip()}", shlex.split(line, comments=True)))
    return found


def test_the_docs_show_the_after_training_commands():
    verbs = {argv[1] for _, argv in doc_commands()}
    assert verbs == {"generate", "chat", "eval"}, verbs


@pytest.fixture(scope="module")
def workdir(quickstart_cache, tmp_path_factory):
    """A scratch directory with ``recipes/`` and a trained ``outputs/quickstart/final``."""
    work = tmp_path_factory.mktemp("docs-run")
    (work / "recipes").symlink_to(ROOT / "recipes")
    proc = subprocess.run([sys.executable, "-m", "nxd_finetune", "run", "recipes/quickstart.yaml", *SHORT],
                          cwd=work, env=_env(work), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "outputs" / "quickstart" / "final" / "adapter_config.json").is_file()
    return work


def _env(work: Path) -> dict[str, str]:
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)}


@pytest.mark.parametrize(("where", "argv"), doc_commands(), ids=[w for w, _ in doc_commands()])
def test_doc_command_runs(workdir, where, argv):
    assert argv[0] == "nxd-finetune"
    stdin = "Is 7 even or odd?\n/exit\n" if argv[1] == "chat" else None
    proc = subprocess.run([sys.executable, "-m", "nxd_finetune", *argv[1:]], cwd=workdir, env=_env(workdir),
                          input=stdin, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{where}\n{proc.stderr[-3000:]}"
    if argv[1] in ("generate", "chat"):
        assert proc.stdout.strip(), f"{where}: no answer printed"
    else:
        assert "exact" in proc.stdout.lower(), proc.stdout  # --generate scores exact match
        scores = json.loads((workdir / "outputs" / "quickstart" / "eval.json").read_text())
        assert scores, "eval wrote no scores"

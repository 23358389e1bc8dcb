"""LoRA SFT of the quickstart's tiny Llama for 10 steps on a real XLA device (torch_xla,
``PJRT_DEVICE=CPU``), against the same run in eager mode on the CPU: same losses and gradient norms
step by step, same eval before and after, same adapter; the step is one graph, compiled during
the first two steps and never again; no host read adds a graph. Then 6 steps each of ``bf16`` and
``bf16-mixed``: losses within bf16 rounding of the eager CPU run, the same graph discipline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed (make test-xla builds .venv-xla)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nxd_finetune.recipe import load_recipe  # noqa: E402
from nxd_finetune.sft import trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEPS = 10
# fp32 on both sides; XLA fuses and reorders reductions, so values agree to float rounding that
# ten Adam steps amplify a little
RTOL = 1e-3


def train_on(device: str, out: Path, *overrides: str, steps: int = STEPS) -> tuple[dict, list[dict]]:
    recipe = load_recipe(REPO / "recipes" / "quickstart.yaml", [
        f"training.device={device}", f"training.max_steps={steps}", "training.warmup_steps=2",
        "eval.every_n_steps=null", "eval.max_batches=4", "checkpoint.every_n_steps=null",
        "logging.every_n_steps=1", "logging.progress=false", f"output.dir={out}", *overrides,
    ])
    summary = trainer.run(recipe)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "train_loss" in r]


def print_table(cpu: list[dict], xla: list[dict], summary: dict, capsys, title: str) -> None:
    """The step-by-step comparison, printed into `make test-xla`'s output."""
    lines = [title, f"{'step':>4} {'cpu loss':>10} {'xla loss':>10} {'rel diff':>9} {'cpu |g|':>9} {'xla |g|':>9} "
                    f"{'graphs compiled':>15} {'graphs run':>10}"]
    for c, x, comp, ran in zip(cpu, xla, summary["xla_compiles"], summary["xla_graphs"], strict=True):
        rel = abs(c["train_loss"] - x["train_loss"]) / abs(c["train_loss"])
        lines.append(f"{c['step']:>4} {c['train_loss']:>10.6f} {x['train_loss']:>10.6f} {rel:>9.2e} "
                     f"{c['grad_norm']:>9.4f} {x['grad_norm']:>9.4f} {comp:>15} {ran:>10}")
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("xla-train")
    # xla first: autograd sizes its per-device queues at the first backward of the process, and
    # the XLA device must exist by then (a process that trains on one device never meets this)
    return {device: (*train_on(device, tmp / device), tmp / device) for device in ("xla", "cpu")}


def test_losses_match_the_eager_cpu_run(runs, capsys):
    (_, cpu, _), (summary, xla, _) = runs["cpu"], runs["xla"]
    assert [r["step"] for r in xla] == list(range(1, STEPS + 1)) == [r["step"] for r in cpu]
    print_table(cpu, xla, summary, capsys, "fp32")
    for c, x in zip(cpu, xla, strict=True):
        assert x["train_loss"] == pytest.approx(c["train_loss"], rel=RTOL), (c, x)
        assert x["grad_norm"] == pytest.approx(c["grad_norm"], rel=RTOL), (c, x)
        assert x["lr"] == pytest.approx(c["lr"], rel=1e-12) and x["tokens"] == c["tokens"]
    assert cpu[-1]["train_loss"] < cpu[0]["train_loss"] / 2  # it learns


def test_graph_count_stops_growing_after_step_2(runs):
    summary = runs["xla"][0]
    compiles, graphs = summary["xla_compiles"], summary["xla_graphs"]
    assert len(compiles) == len(graphs) == STEPS
    assert compiles[2:] == [compiles[1]] * (STEPS - 2), compiles
    # one graph per optimizer step: logging, token counts and the loss are read in step closures
    assert [b - a for a, b in zip(graphs[1:], graphs[2:], strict=False)] == [1] * (STEPS - 2), graphs


def test_eval_and_the_saved_adapter_match(runs):
    (cpu_summary, _, cpu_dir), (xla_summary, _, xla_dir) = runs["cpu"], runs["xla"]
    for when in ("eval_before", "eval_after"):
        c, x = cpu_summary[when], xla_summary[when]
        assert x["eval_loss"] == pytest.approx(c["eval_loss"], rel=RTOL)
        assert x["eval_accuracy"] == pytest.approx(c["eval_accuracy"], abs=0.01)
    cpu_adapter = load_file(cpu_dir / "final" / "adapter_model.safetensors")
    xla_adapter = load_file(xla_dir / "final" / "adapter_model.safetensors")
    assert cpu_adapter.keys() == xla_adapter.keys() and len(cpu_adapter) > 0
    for name, c in cpu_adapter.items():
        x = xla_adapter[name]
        assert x.device.type == "cpu" and x.dtype == c.dtype == torch.float32
        assert torch.allclose(x, c, rtol=RTOL, atol=1e-4), name
    config = json.loads((xla_dir / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 16


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_bf16_precisions_run_as_one_graph_per_step(precision, tmp_path, capsys):
    """``training.precision=bf16`` (bf16 weights and LoRA factors) and ``bf16-mixed`` (fp32 weights,
    bf16 autocast: q/k leave the rotary embedding in fp32, v in bf16, so the model casts them to one
    dtype before attention): one graph per step, none compiled after step 2, and losses within bf16
    rounding of the eager CPU run under the same precision (autocast's op lists differ between the
    CPU and XLA, so the two runs round at different places)."""
    steps = 6
    runs = {device: train_on(device, tmp_path / device, f"training.precision={precision}", "data.eval=null",
                             steps=steps)
            for device in ("xla", "cpu")}
    (summary, xla), (_, cpu) = runs["xla"], runs["cpu"]
    print_table(cpu, xla, summary, capsys, precision)
    assert summary["xla_compiles"][1:] == [summary["xla_compiles"][1]] * (steps - 1), summary["xla_compiles"]
    graphs = summary["xla_graphs"]
    assert [b - a for a, b in zip(graphs[1:], graphs[2:], strict=False)] == [1] * (steps - 2), graphs
    assert [r["step"] for r in xla] == list(range(1, steps + 1)) == [r["step"] for r in cpu]
    for c, x in zip(cpu, xla, strict=True):
        assert x["train_loss"] == pytest.approx(c["train_loss"], rel=2e-2), (c, x)
    assert cpu[-1]["train_loss"] < cpu[0]["train_loss"] / 2  # it learns

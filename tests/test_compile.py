"""``model.compile``: each decoder layer's work around the attention kernel through ``torch.compile``
(inductor, C++ kernels on this CPU).

- Model level, per family (Llama, Qwen3's q/k norms, Phi-3's fused projections, Gemma 2's sandwich
  norms, windows and soft-capped scores): the compiled model's logits equal `transformers`' eager
  ones, packed rows equal the samples alone, and its gradients equal the eager model's.
- Trainer level: the compiled run reproduces the eager single-process run (loss curve, gradient
  norms, eval, the adapter or checkpoint files) with LoRA dropout (inductor draws its masks as
  eager does), activation checkpointing and full fine-tuning, and under tp=2 with sequence
  parallel and checkpointing, pp=2 with checkpointing (1F1B) and dp=2 with ZeRO-1, in one launch
  of two spawned gloo workers.
- Refused in one line where it cannot run (XLA; no C++ compiler on a CPU).

Each case starts from a fresh dynamo (``torch._dynamo.reset``) and checks that inductor really
compiled the graphs (dynamo's counters), so a silent fallback to eager fails the test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM

from nxd_finetune.cli import main
from nxd_finetune.errors import NxdError
from nxd_finetune.models import load_pretrained
from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import engine, trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
FAMILIES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
}
BASE = ["data.max_seq_len=64", "training.max_steps=6", "training.micro_batch_size=2", "training.warmup_steps=2",
        "training.eps=1e-6", "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null",
        "checkpoint.every_n_steps=null", "training.grad_accum=2"]
# LoRA dropout only in one process: its masks follow the layout's draws (dp, pp and sequence
# parallel draw in another order than one process does, compiled or not)
MODES = {"lora": [], "lora-dropout": ["lora.dropout=0.1"], "sft": ["lora=null", "training.lr=5e-4"]}
LAYOUT_MODES = ("lora", "sft")
LAYOUTS = {  # every layout sees 4 rows per optimizer step
    "tp2-sp-ckpt": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.activation_checkpointing=full"],
    "pp2-ckpt": ["parallel.pp=2", "parallel.activation_checkpointing=full"],
    "dp2-zero1": ["parallel.zero1=true", "training.grad_accum=1"],
}

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled() -> int:
    """Graphs inductor compiled since the last reset (0 when everything ran eagerly)."""
    return counters["aot_autograd"]["ok"]


def _family_model(make_tiny_hf, name: str):
    family, overrides = FAMILIES[name]
    hf, path = make_tiny_hf(family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    return hf, path


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_compiled_model_equals_transformers_and_eager(make_tiny_hf, name):
    hf, path = _family_model(make_tiny_hf, name)
    compiled, eager = load_pretrained(path), load_pretrained(path)
    compiled.set_compile(True)
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in (7, 12, 5)]
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    seg = torch.cat([torch.full((len(s),), i + 1) for i, s in enumerate(samples)])[None]
    with torch.no_grad():
        alone = torch.cat([hf(s[None]).logits[0] for s in samples])
        batch = torch.stack([s[:5] for s in samples])
        assert (compiled(batch) - hf(batch).logits).abs().max() <= 1e-5
        assert (compiled(ids, pos, seg)[0] - alone).abs().max() <= 1e-5
    for model in (compiled, eager):
        model.train()
        logits = model(ids, pos, seg)
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    assert _compiled() >= 2, dict(counters["aot_autograd"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    grads = dict(eager.named_parameters())
    for n, p in compiled.named_parameters():
        assert p.grad is not None, n
        assert torch.allclose(p.grad, grads[n].grad, rtol=1e-4, atol=1e-6), (n, (p.grad - grads[n].grad).abs().max())


def recipe(out: Path, nproc: int, *overrides: str):
    return load_recipe(QUICKSTART, [*BASE, f"parallel.nproc={nproc}", f"output.dir={out}", *overrides])


def _curve(summary: dict, key: str = "train_loss") -> list[float]:
    return [h[key] for h in summary["history"]]


def _final_tensors(summary: dict) -> dict[str, torch.Tensor]:
    final = Path(summary["output"])
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(final / name)


def _check_same(name: str, got: dict, ref: dict) -> None:
    assert len(_curve(got)) == len(_curve(ref)) == 6, name
    assert _curve(got) == pytest.approx(_curve(ref), rel=1e-5), name
    assert _curve(got, "grad_norm") == pytest.approx(_curve(ref, "grad_norm"), rel=1e-4), name
    assert got["eval_after"]["eval_loss"] == pytest.approx(ref["eval_after"]["eval_loss"], rel=1e-5), name
    tg, tr = _final_tensors(got), _final_tensors(ref)
    assert tg.keys() == tr.keys(), name
    for k in tr:
        diff = (tg[k].float() - tr[k].float()).abs().max().item()
        assert diff <= 2e-5, (name, k, diff)


@pytest.fixture(scope="module")
def references(quickstart_cache, tmp_path_factory):
    """The eager single-process runs every compiled run is held to."""
    out = tmp_path_factory.mktemp("eager")
    return {mode: trainer.run(recipe(out / mode, 1, *extra)) for mode, extra in MODES.items()}


@pytest.mark.parametrize("mode, extra", [("lora-dropout", []),
                                         ("lora-dropout", ["parallel.activation_checkpointing=full"]), ("sft", [])])
def test_compiled_run_reproduces_the_eager_run(references, tmp_path, mode, extra):
    got = trainer.run(recipe(tmp_path / "compiled", 1, *MODES[mode], "model.compile=true", *extra))
    assert _compiled() >= 2, dict(counters["aot_autograd"])
    _check_same(f"{mode} {extra}", got, references[mode])


def _run_layouts(recipe_dicts: list[dict]) -> list[tuple[dict | None, int]]:
    """Worker: every recipe in turn from a fresh dynamo; each summary with the graphs compiled."""
    torch.set_num_threads(1)
    results = []
    for d in recipe_dicts:
        torch._dynamo.reset()
        counters.clear()
        results.append((trainer.run_rank(recipe_from_dict(d)), _compiled()))
    return results


def test_compiled_layouts_reproduce_the_eager_single_process(references, tmp_path):
    dicts, names = [], []
    for mode in LAYOUT_MODES:
        for name, layout in LAYOUTS.items():
            names.append(f"{mode}/{name}")
            dicts.append(recipe(tmp_path / mode / name, 2, *MODES[mode], *layout, "model.compile=true").to_dict())
    # spawned, not forked: a fork after this process compiled inherits inductor's compile pool
    # without its threads, and the child waits on it for ever
    results = launch(_run_layouts, 2, dicts, start_method="spawn")
    for rank_results in results:
        for name, (_, graphs) in zip(names, rank_results, strict=True):
            assert graphs >= 2, name
    for name, (got, _) in zip(names, results[0], strict=True):
        _check_same(name, got, references[name.split("/")[0]])


def test_compile_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(NxdError, match="model.compile=inductor does not apply to device xla \\(torch_xla compiles"):
        engine._check_compile(torch.device("xla"))
    with pytest.raises(NxdError, match="model.compile=sometimes: torch.compile has no backend 'sometimes' here"):
        engine._check_compile(torch.device("cpu"), "sometimes")
    with pytest.raises(NxdError, match="model.compile=inductor: inductor generates no code for device meta; name "
                                       "the device's own torch.compile backend"):
        engine._check_compile(torch.device("meta"))
    engine._check_compile(torch.device("meta"), "aot_eager")  # a backend that runs the device's own kernels
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(NxdError, match="needs a C\\+\\+ compiler"):
        engine._check_compile(torch.device("cpu"))


def test_compile_key_in_recipe_and_validate(capsys, quickstart_cache):
    """The key is read (a bool or a backend's name) and the recipe with it validates; a backend
    torch does not have fails validate in one line."""
    assert load_recipe(QUICKSTART, ["model.compile=true"]).model.compile is True
    for value, code in (("true", 0), ("sometimes", 2)):
        with pytest.raises(SystemExit) as info:
            main(["validate", str(QUICKSTART), f"model.compile={value}"])
        assert (info.value.code or 0) == code, capsys.readouterr().err
    assert "model.compile" in capsys.readouterr().err

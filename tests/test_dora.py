"""DoRA (``lora.use_dora``) against ``peft``'s DoRA, fp32 on tiny ``transformers`` models: logits
and one training step, the adapter files both ways, the fresh init, merging (in memory and from
the files), ``lora.init_from``; tensor parallel against the unsharded model with the harness of
``test_parallel_lora``; the trainer's tp2, pp2 and dp2 + ZeRO-1 runs against one process (real
gloo), as ``test_parallel_run``."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
from gloo_world import assert_checks, run_world
from parallel_lora_helpers import IDS as TP_IDS
from parallel_lora_helpers import lora_worker, n_checks
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nxd_finetune.errors import AdapterError, RecipeError
from nxd_finetune.lora import (
    LoraConfig,
    base_param_name,
    inject_lora,
    load_adapter,
    lora_modules,
    merge_lora,
    save_adapter,
    trainable_parameters,
)
from nxd_finetune.lora.dora import DoraLinear, init_dora_magnitudes
from nxd_finetune.lora.init_from import check_same_lora
from nxd_finetune.lora.io import check_adapter_files
from nxd_finetune.lora.merge import merge_adapter
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer

TOL = 1e-5
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(7))
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("workers_tmpdir")


def hf_load(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def peft_dora(base: Path, out: Path | None = None, seed: int = 2, **kw):
    """PEFT's DoRA model (all-linear, r=4) with every trainable tensor moved off its init; saved to ``out``."""
    pm = peft.get_peft_model(hf_load(base), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16,
                                                           target_modules="all-linear", use_dora=True, **kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    if out is not None:
        pm.save_pretrained(out)
    return pm


def peft_name(name: str) -> str:
    """Our parameter name -> PEFT's (adapter ``default``)."""
    if name.endswith(".lora_magnitude_vector"):
        return f"base_model.model.{name}.default.weight"
    return "base_model.model." + name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")


def next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- PEFT parity


@pytest.mark.parametrize("family, dropout", [("llama", 0.0), ("qwen2", 0.0), ("llama", 0.2)])
def test_logits_and_a_training_step_match_peft(family, dropout, make_tiny_hf, tmp_path):
    """PEFT's DoRA adapter loaded into ours: same logits, same gradients of every factor and
    magnitude, same logits after one SGD step (qwen2: biased q/k/v; dropout: ``W drop(x)``, the
    same masks drawn in the same order)."""
    _, base = make_tiny_hf(family)
    pm = peft_dora(base, tmp_path / "peft", lora_dropout=dropout)
    ours = load_pretrained(base)
    cfg = load_adapter(ours, tmp_path / "peft")
    assert cfg.use_dora and all(isinstance(m, DoraLinear) for _, m in lora_modules(ours))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(IDS), pm.eval()(IDS).logits, atol=TOL, rtol=TOL)
    theirs = dict(pm.named_parameters())
    models = ((ours, lambda: ours(IDS)), (pm, lambda: pm(IDS).logits))
    for model, run in models:
        model.train()
        torch.manual_seed(11)  # dropout masks
        next_token_loss(run()).backward()
    params = trainable_parameters(ours)
    assert sum(n.endswith(".lora_magnitude_vector") for n, _ in params) == 14
    assert {peft_name(n) for n, _ in params} == {n for n, p in theirs.items() if p.requires_grad}
    for name, p in params:
        torch.testing.assert_close(p.grad, theirs[peft_name(name)].grad, atol=TOL, rtol=TOL, msg=name)
    assert all(p.grad.abs().max() > 0 for n, p in params if n.endswith("magnitude_vector"))
    for model, _ in models:
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(IDS), pm.eval()(IDS).logits, atol=TOL, rtol=TOL)


def test_fresh_adapter_is_peft_init_and_our_files_load_in_peft(make_tiny_hf, tmp_path):
    """A fresh DoRA adapter: magnitude ``||W||`` per output row as PEFT's, output unchanged. Ours,
    trained a little, is PEFT's file format (same keys, shapes, config) and PEFT's logits."""
    _, base = make_tiny_hf("qwen2")
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", use_dora=True)
    ours = load_pretrained(base).eval()
    plain = ours(IDS).detach()
    inject_lora(ours, cfg)
    fresh = peft.get_peft_model(hf_load(base), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16,
                                                              target_modules="all-linear", use_dora=True))
    with torch.no_grad():
        for name, p in trainable_parameters(ours):
            if name.endswith("magnitude_vector"):
                torch.testing.assert_close(p, fresh.get_parameter(peft_name(name)), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours(IDS), plain, atol=1e-6, rtol=1e-6)
        for _, p in sorted(trainable_parameters(ours)):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.05)
        expected = ours(IDS)
    save_adapter(ours, cfg, tmp_path / "ours", base_model_name_or_path=str(base))
    peft_dora(base, tmp_path / "peft")
    mine, theirs = load_file(tmp_path / "ours" / WEIGHTS), load_file(tmp_path / "peft" / WEIGHTS)
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert any(k.endswith("q_proj.lora_magnitude_vector") for k in mine)
    assert json.loads((tmp_path / "ours" / CONFIG).read_text())["use_dora"] is True
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf_load(base), tmp_path / "ours").eval()(IDS).logits
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)


def test_merge_folds_as_peft(make_tiny_hf, tmp_path):
    """``merge_lora``, ``unmerge`` and ``nxd-finetune merge`` (from the files) equal PEFT's
    ``merge_and_unload`` weights; the merged models' logits equal the adapter's."""
    _, base = make_tiny_hf("llama")
    pm = peft_dora(base, tmp_path / "peft")
    with torch.no_grad():
        expected = pm(IDS).logits
    peft_merged = pm.merge_and_unload().state_dict()
    ours = load_pretrained(base).eval()
    load_adapter(ours, tmp_path / "peft")
    before = {n: m.weight.detach().clone() for n, m in lora_modules(ours)}
    for _, m in lora_modules(ours):
        m.merge()
        m.unmerge()
    for n, m in lora_modules(ours):
        torch.testing.assert_close(m.weight, before[n], atol=1e-6, rtol=1e-6)
    merge_lora(ours)
    merge_adapter(tmp_path / "peft", base, tmp_path / "merged")
    from_files = load_file(tmp_path / "merged" / "model.safetensors")
    for key, w in ours.state_dict().items():
        torch.testing.assert_close(w, peft_merged[key], atol=1e-6, rtol=1e-6, msg=key)
        torch.testing.assert_close(from_files[key], peft_merged[key], atol=1e-6, rtol=1e-6, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), expected, atol=TOL, rtol=TOL)
        torch.testing.assert_close(hf_load(tmp_path / "merged")(IDS).logits, expected, atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------------- config and refusals


def test_config_files_and_refusals_are_one_line(make_tiny_hf, tmp_path):
    _, base = make_tiny_hf("llama")
    peft_dora(base, tmp_path / "peft")
    cfg = check_adapter_files(tmp_path / "peft")
    assert cfg.use_dora and LoraConfig.from_peft_dict(cfg.to_peft_dict(None)) == cfg
    assert cfg.to_section()["use_dora"] is True and "use_dora" not in LoraConfig().to_section()
    plain = dict(cfg.__dict__, use_dora=False)
    errors = []
    # the config says DoRA, the file holds no magnitudes (and the reverse)
    tensors = load_file(tmp_path / "peft" / WEIGHTS)
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k}, tmp_path / "peft" / WEIGHTS)
    with pytest.raises(AdapterError) as e:
        check_adapter_files(tmp_path / "peft")
    errors.append(str(e.value))
    assert "use_dora=True but the file holds no lora_magnitude_vector tensors" in errors[-1]
    with pytest.raises(AdapterError, match="use_dora does not work with target_parameters") as e:
        LoraConfig(target_parameters=["mlp.experts.down_proj"], target_modules=[], use_dora=True)
    errors.append(str(e.value))
    with pytest.raises(AdapterError, match="the recipe has lora.use_dora=False but the adapter has True") as e:
        check_same_lora(LoraConfig(**plain), cfg, DecoderConfig.from_hf(base), "x")
    errors.append(str(e.value))
    model = load_pretrained(base)
    inject_lora(model, LoraConfig(**plain))
    save_adapter(model, LoraConfig(**plain), tmp_path / "plain", None)
    dora_model = load_pretrained(base)
    inject_lora(dora_model, cfg)
    with pytest.raises(AdapterError, match="adapter has use_dora=False but model.layers.0.self_attn.q_proj is a") as e:
        load_adapter(dora_model, tmp_path / "plain", inject=False)
    errors.append(str(e.value))
    assert all("\n" not in line for line in errors)


def test_recipe_use_dora_and_its_refusals(tmp_path):
    rec = load_recipe(ROOT / "recipes" / "quickstart.yaml", ["lora.use_dora=true"])
    assert rec.lora is not None and LoraConfig.from_section(rec.lora).use_dora
    for overrides, needle in [
        (["lora.use_dora=true", "lora.target_parameters=[mlp.experts.down_proj]"], "lora.target_parameters"),
        (["lora.use_dora=true", "model.quantization.method=int8"], "lora.use_dora with model.quantization.method=int8"),
    ]:
        with pytest.raises(RecipeError, match=needle) as e:
            load_recipe(ROOT / "recipes" / "quickstart.yaml", overrides)
        assert "\n" not in str(e.value)


def test_meta_injection_waits_for_the_weights(make_tiny_hf):
    """Injected on the meta device the magnitude is unknown: forward refuses in one line until
    ``init_dora_magnitudes`` (after the weights are read) sets it to the eager model's."""
    _, base = make_tiny_hf("llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], use_dora=True)
    eager = load_pretrained(base)
    inject_lora(eager, cfg)
    model = build_model(DecoderConfig.from_hf(base))
    inject_lora(model, cfg)
    materialize(model, base, name_map=base_param_name)
    with pytest.raises(AdapterError, match="magnitude was never set: call init_dora_magnitudes"):
        model(IDS)
    init_dora_magnitudes(model)
    for name, p in trainable_parameters(model):
        if name.endswith("magnitude_vector"):
            torch.testing.assert_close(p, eager.get_parameter(name), atol=0, rtol=0)


# ----------------------------------------------------------------------------- layouts


def test_tp2_dora_matches_unsharded_and_peft(make_tiny_hf, tmp_path):
    """tp=2 with and without sequence parallel, and dropout: logits, every gradient (magnitudes
    of row-parallel layers whole, of column-parallel layers split), the export, merge/unmerge equal
    the unsharded DoRA model; the tp=2 file is the tp=1 file byte for byte and PEFT's logits."""
    _, base = make_tiny_hf("llama")
    pm = peft_dora(base, tmp_path / "peft")
    with torch.no_grad():
        peft_logits = pm(TP_IDS).logits
    variants = [("llama", str(base), str(tmp_path / "peft"), (False, True), True)]
    results = run_world(lora_worker, 2, tmp_path, 2, variants, str(tmp_path / "saved"), timeout=600)
    assert assert_checks(results) == 2 * n_checks(tmp_path / "peft", {False: 1, True: 2}, dropout=True)
    for sp in (False, True):
        torch.testing.assert_close(results[0][f"llama tp=2 sp={sp} logits"][1], peft_logits, atol=TOL, rtol=TOL)
    tp2, tp1 = tmp_path / "saved" / "llama-tp", tmp_path / "saved" / "llama-tp1"
    assert (tp2 / WEIGHTS).read_bytes() == (tp1 / WEIGHTS).read_bytes()


# the quickstart, 4 steps of 4 rows of 64 tokens (micro 2 x accum x dp), AdamW eps 1e-6 (test_parallel_run),
# a checkpoint every 2 steps
RUN = ["data.max_seq_len=64", "training.max_steps=4", "training.micro_batch_size=2", "training.warmup_steps=1",
       "training.eps=1e-6", "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null",
       "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "lora.use_dora=true"]
LAYOUTS = {"tp2": ["parallel.tp=2", "training.grad_accum=2"], "pp2": ["parallel.pp=2", "training.grad_accum=2"],
           "dp2-zero1": ["parallel.zero1=true", "training.grad_accum=1"]}


def _train(recipe_dicts: list[dict]) -> list[dict | None]:
    """Worker of the launched world: ``trainer.run_rank`` of each recipe (rank 0's summaries)."""
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def layout_recipe(out: Path, nproc: int, *overrides: str):
    return load_recipe(ROOT / "recipes" / "quickstart.yaml",
                       [*RUN, f"parallel.nproc={nproc}", f"output.dir={out}", *overrides])


def _assert_same_run(name: str, got: dict, ref: dict) -> None:
    """Loss curve (1e-5) and gradient norms (1e-4) relative, eval loss, the exported adapter (1e-5)."""
    for key, rtol in (("train_loss", 1e-5), ("grad_norm", 1e-4)):
        curves = [torch.tensor([h[key] for h in s["history"]], dtype=torch.float64) for s in (got, ref)]
        torch.testing.assert_close(*curves, rtol=rtol, atol=0, msg=f"{name} {key}")
    assert got["eval_after"]["eval_loss"] == pytest.approx(ref["eval_after"]["eval_loss"], rel=1e-5), name
    files, ref_files = (load_file(Path(s["output"]) / WEIGHTS) for s in (got, ref))
    assert files.keys() == ref_files.keys(), name
    for key, t in files.items():
        torch.testing.assert_close(t, ref_files[key], atol=1e-5, rtol=0, msg=f"{name} {key}")


def test_trainer_layouts_match_one_process(quickstart_cache, tmp_path):
    """The trainer with ``lora.use_dora``: tp2, pp2 and dp2 + ZeRO-1 (real gloo) equal the one-process
    run (loss curve, gradient norms, eval, the exported adapter, which PEFT reads as DoRA); tp2's
    step-2 checkpoint (column-parallel magnitudes split) resumed in one process ends there too."""
    ref = trainer.run(layout_recipe(tmp_path / "ref", 1, "training.grad_accum=2"))
    dicts = [layout_recipe(tmp_path / name, 2, *layout).to_dict() for name, layout in LAYOUTS.items()]
    results = launch(_train, 2, dicts, start_method="fork")
    for name, got in zip(LAYOUTS, results[0], strict=True):
        _assert_same_run(name, got, ref)
    step2 = tmp_path / "tp2" / "checkpoints" / "step-00000002"
    resumed = trainer.run(layout_recipe(tmp_path / "resumed", 1, "training.grad_accum=2",
                                        f"checkpoint.resume={step2}"))
    assert str(resumed["resumed_from"]).endswith("step-00000002")
    _assert_same_run("tp2 resumed at tp1", resumed, ref)
    final = Path(ref["output"])
    assert peft.LoraConfig.from_pretrained(final).use_dora
    assert sum(k.endswith(".lora_magnitude_vector") for k in load_file(final / WEIGHTS)) == 4 * 7


def test_init_from_a_peft_dora_adapter(quickstart_cache, tmp_path):
    """``lora.init_from`` a PEFT DoRA adapter with ``lora.use_dora``: the built model is PEFT's (its
    magnitudes too, not ``||W||``); without ``use_dora`` in the recipe it is one error line."""
    from nxd_finetune.data.inputs import resolve_model_dir
    from nxd_finetune.sft.engine import build_engine

    rec = layout_recipe(tmp_path, 1)
    model_dir = resolve_model_dir(rec.model.path)
    pm = peft.get_peft_model(hf_load(model_dir), peft.LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32,
                                                                 target_modules="all-linear", use_dora=True))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in pm.named_parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
        expected = pm.eval()(IDS).logits
    pm.save_pretrained(tmp_path / "peft")
    built = build_engine(layout_recipe(tmp_path, 1, f"lora.init_from={tmp_path / 'peft'}"), model_dir,
                         torch.device("cpu"), 1)
    with torch.no_grad():
        torch.testing.assert_close(built.model.eval()(IDS), expected, atol=TOL, rtol=TOL)
    plain = layout_recipe(tmp_path, 1, "lora.use_dora=false", f"lora.init_from={tmp_path / 'peft'}")
    with pytest.raises(AdapterError, match="the recipe has lora.use_dora=False but the adapter has True") as e:
        build_engine(plain, model_dir, torch.device("cpu"), 1)
    assert "\n" not in str(e.value)

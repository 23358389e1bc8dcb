"""The families beyond Llama on every parallel layout, through the trainer (real gloo groups).

A tiny random checkpoint of each family (built with `transformers`, the quickstart's tokenizer
beside it) trains the quickstart's data for 4 optimizer steps of 4 packed 64-token rows, fp32,
LoRA (``all-linear``) and full fine-tuning. The reference is the single-process ``trainer.run``;
tp2, tp2 + sequence parallel, pp2 (the family's tied embeddings split over the two stages) and
dp2 + ZeRO-1 run in one launch of two forked workers (``trainer.run_rank``) and must reproduce its
loss curve (1e-5 relative), gradient norms (1e-4), eval statistics and final adapter / checkpoint
(2e-5); so must LoRA saved ``merged`` from tp2 and pp2, and tp2 resuming the reference's step-2
checkpoint. AdamW's ``eps`` is 1e-5: an element whose gradient is at rounding level would otherwise
turn summation-order noise into visible weight differences (Gemma's gradients reach ~60, so that
level is ~1e-6; tests/test_parallel_run.py does the same at 1e-6 on Llama).

Gemma 2's final soft-cap runs inside the vocab-parallel loss, chunked on pp2's last stage
(``training.loss_chunk_tokens``). Qwen3's and Gemma 3's per-head q/k norms see only a rank's heads
under tp, so their gradients are summed over the tp group; AdamW's first steps hide a gradient's
scale, so a gradient-level check (one forward/backward at tp2, with and without sequence parallel,
every gradient gathered and compared with the unsharded model's; Phi's fused rows checked by head)
runs first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from layout_helpers import assert_same_curves, assert_same_files, assert_same_finish, final_tensors, run_layouts
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nxd_finetune.loss import ce_sum, shift_labels
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.parallel import Layout, ParallelState, allreduce_replicated_grads, apply_tp_plan, tp_plan_for
from nxd_finetune.parallel.launch import init_distributed, launch
from nxd_finetune.parallel.placement import gather_full, iter_placements
from nxd_finetune.parallel.plan import make_slice_reader
from nxd_finetune.quickstart import ensure_tiny_model
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft import trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS = 4
BASE = ["data.max_seq_len=64", f"training.max_steps={STEPS}", "training.micro_batch_size=2",
        "training.warmup_steps=1", "training.eps=1e-5", "logging.progress=false", "logging.every_n_steps=1",
        "eval.every_n_steps=null", "checkpoint.every_n_steps=null"]
LAYOUTS = {  # every layout sees 4 rows per optimizer step (micro 2 x accum x dp)
    "tp2": ["parallel.tp=2", "training.grad_accum=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "training.grad_accum=2"],
    "pp2": ["parallel.pp=2", "training.grad_accum=2", "training.loss_chunk_tokens=16"],
    "dp2-zero1": ["parallel.zero1=true", "training.grad_accum=1"],
}
MODES = {"lora": ["lora.target_modules=all-linear"], "sft": ["lora=null", "training.lr=5e-4"]}
MERGED = {"merged": ["lora.target_modules=all-linear", "checkpoint.save_mode=merged"]}
RESUMED = ["parallel.tp=2", "training.grad_accum=2"]
# family -> the tiny transformers config (on top of tests/conftest.py's TINY)
FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5)),
    # a sliding layer then a full one, capped attention scores and logits, tied embeddings
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=0.5,
                              final_logit_softcapping=5.0)),
    # per-head q/k norms (1 + weight), local rope base on the sliding layers, linear rope scaling on the full one
    "gemma3": ("gemma3", dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


def _family_dir(make_tiny_hf, family: str) -> Path:
    """The family's tiny checkpoint with the quickstart tokenizer (vocabulary rounded up to even)."""
    tok_dir = ensure_tiny_model()
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    kind, overrides = FAMILIES[family]
    _, path = make_tiny_hf(kind, **{**overrides, "vocab_size": vocab + vocab % 2})
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def _recipe(model: Path, out: Path, nproc: int, *overrides: str):
    return load_recipe(QUICKSTART, [*BASE, f"model.path={model}", f"parallel.nproc={nproc}", f"output.dir={out}",
                                    *overrides])


def _assert_same_run(name: str, got: dict, ref: dict) -> None:
    assert_same_curves(name, got, ref, STEPS)
    assert got["eval_after"]["eval_loss"] == pytest.approx(ref["eval_after"]["eval_loss"], rel=1e-5), name
    assert_same_files(name, got, ref)


def _tp2_grads(model_dirs: dict[str, str]) -> dict[str, float]:
    """Worker: ``family/sp/parameter`` -> the largest difference between the tp2 gradient and the
    unsharded model's (relative to the gradient's largest element where that exceeds 1), and
    ``.../before-sync`` (absolute) for parameters whose gradient is summed over tp, before that sum;
    ``.../loss`` the loss's (relative)."""
    torch.set_num_threads(1)
    init_distributed("gloo")
    state = ParallelState(Layout.for_world(2, tp=2))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[:, :3] = -100
    out: dict[str, float] = {}
    for family, model_dir in model_dirs.items():
        ref = load_pretrained(model_dir)
        loss_ref = ce_sum(ref(ids), shift_labels(labels))
        loss_ref.backward()
        for sp in (False, True):
            config = DecoderConfig.from_hf(model_dir)
            model = apply_tp_plan(build_model(config), tp_plan_for(config), state, sequence_parallel=sp)
            materialize(model, model_dir, reader=make_slice_reader(model))
            loss = ce_sum(model(ids), shift_labels(labels), state.group("tp"))
            loss.backward()
            tag = f"{family}/sp={sp}"
            if config.fused_qkv:  # split by head: this rank's q heads, then its k heads and its v heads
                r, d = state.coord("tp"), config.head_dim
                nq, nkv = config.num_attention_heads, config.num_key_value_heads
                full = ref.model.layers["0"].self_attn.qkv_proj.weight
                rows = [full[r * nq * d // 2:(r + 1) * nq * d // 2]]
                rows += [full[nq * d + i * nkv * d + r * nkv * d // 2:][:nkv * d // 2] for i in (0, 1)]
                local = model.model.layers["0"].self_attn.qkv_proj.weight
                out[f"{tag}/qkv_proj rows"] = (local - torch.cat(rows)).abs().max().item()
                gate_up = ref.model.layers["0"].mlp.gate_up_proj.weight.chunk(2)
                local = model.model.layers["0"].mlp.gate_up_proj.weight
                halves = torch.cat([h.chunk(2)[r] for h in gate_up])
                out[f"{tag}/gate_up_proj rows"] = (local - halves).abs().max().item()
            out[f"{tag}/loss"] = (loss - loss_ref).abs().item() / loss_ref.item()  # relative: a sum
            specs = {name: spec for name, _, _, spec in iter_placements(model)}
            for name, p in model.named_parameters():
                if name in specs and specs[name].partial_sums(state.layout) and not specs[name].sharded:
                    out[f"{tag}/{name}/before-sync"] = (p.grad - ref.get_parameter(name).grad).abs().max().item()
            allreduce_replicated_grads(model, state)
            for name, p in model.named_parameters():
                full = gather_full(p.grad, specs[name], state) if name in specs else p.grad
                want = ref.get_parameter(name).grad
                # relative to the gradient's scale where it exceeds 1 (Gemma's embedding scale and
                # 1 + weight norms make gradients of ~60: fp32 summation order moves them by ~1e-6 of that)
                out[f"{tag}/{name}"] = (full - want).abs().max().item() / max(1.0, want.abs().max().item())
    return out


def test_tp2_gradients_equal_the_unsharded_model(make_tiny_hf):
    dirs = {family: str(make_tiny_hf(kind, **overrides)[1]) for family, (kind, overrides) in FAMILIES.items()}
    # Gemma 3 1B's one KV head: tp2 replicates it, and its k_norm, on both ranks
    kind, overrides = FAMILIES["gemma3"]
    dirs["gemma3-kv-replicated"] = str(make_tiny_hf(kind, **{**overrides, "num_key_value_heads": 1})[1])
    got = launch(_tp2_grads, 2, dirs, start_method="fork")[0]
    close = {k: v for k, v in got.items() if not k.endswith("/before-sync")}
    assert max(close.values()) <= 1e-5, sorted(close.items(), key=lambda kv: -kv[1])[:3]
    # the gradients of the per-head norms are partial sums over tp before the sync (so it matters)
    synced = {k for k in got if k.endswith("/before-sync")}
    assert any("q_norm" in k for k in synced) == any(f.startswith(("qwen3", "gemma3")) for f in FAMILIES)
    assert all(got[k] > 1e-3 for k in synced if "_norm" in k and "self_attn" in k), synced


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_layout_reproduces_the_single_process_run(quickstart_cache, make_tiny_hf, tmp_path, family):
    """Every layout of :data:`LAYOUTS` for LoRA and full fine-tuning; LoRA saved ``merged`` (the
    base with the adapter folded in, gathered from tp2 and pp2); and tp2 resuming the reference's
    step-2 checkpoint (saved by one process, read back as tp2 shards: fused projections piece by
    piece) to finish as the reference does."""
    model = _family_dir(make_tiny_hf, family)
    every2 = ["checkpoint.every_n_steps=2", "checkpoint.keep_last=4"]
    refs = {mode: trainer.run(_recipe(model, tmp_path / "ref" / mode, 1, "training.grad_accum=2", *extra, *every2))
            for mode, extra in {**MODES, **MERGED}.items()}
    names, dicts = [], []
    for mode, extra in MODES.items():
        for layout, overrides in {**LAYOUTS, "tp2-resumed": RESUMED}.items():
            if layout == "tp2-resumed":
                step2 = tmp_path / "ref" / mode / "checkpoints" / "step-00000002"
                overrides = [*overrides, f"checkpoint.resume={step2}"]
            names.append(f"{family}/{mode}/{layout}")
            dicts.append(_recipe(model, tmp_path / mode / layout, 2, *overrides, *extra).to_dict())
    for mode, extra in MERGED.items():
        for layout in ("tp2", "pp2"):
            names.append(f"{family}/{mode}/{layout}")
            dicts.append(_recipe(model, tmp_path / mode / layout, 2, *LAYOUTS[layout], *extra).to_dict())
    results = launch(run_layouts, 2, dicts, start_method="fork")
    for name, got in zip(names, results[0], strict=True):
        assert got["parallel"]["nproc"] == 2, name
        ref = refs[name.split("/")[1]]
        if name.endswith("tp2-resumed"):
            assert_same_finish(name, got, ref)
        else:
            _assert_same_run(name, got, ref)
    # full fine-tuning moved every tensor the layouts were compared on (the per-head norms too)
    base, sft = load_file(model / "model.safetensors"), final_tensors(refs["sft"])
    assert base.keys() == sft.keys()
    assert all((base[k] - sft[k]).abs().max() > 1e-4 for k in base), [k for k in base if torch.equal(base[k], sft[k])]
    # the merged checkpoint is a transformers model
    merged = Path(refs["merged"]["output"])
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (load_pretrained(merged).eval()(ids) - hf(ids).logits).abs().max() <= 1e-5

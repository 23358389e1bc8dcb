"""FlexAttention (``model.attention``: the packed-row path on CUDA) against the CPU path and
`transformers`, on packed rows of many short samples (GQA, sliding windows, Gemma 2's soft-capped
scores and ``query_pre_attn_scalar``, Qwen3's q/k norms).

On CPU torch's ``flex_attention`` runs forward only (torch 2.13 refuses its backward there), so:
logits of whole models through the product path under ``no_grad``; gradients at the attention
level through torch's own unfused flex computation (the operator the public function calls),
with our mask and score functions; training with ``flex`` on the GPU in the ``cuda`` tests at the
end (skipped without one)."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from gloo_world import assert_checks, run_world
from torch._higher_order_ops.flex_attention import flex_attention as flex_operator
from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options
from transformers import AutoModelForCausalLM
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    find_packed_sequence_indices,
    packed_sequence_mask_function,
    sliding_window_overlay,
)
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from nxd_finetune.cli import main
from nxd_finetune.errors import NxdError, RecipeError
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.models.attention import _run_attention, _softcapped, attention_layout
from nxd_finetune.models.flex import _softcap_mod, flex_attention_tokens_first, flex_block_mask, uses_flex
from nxd_finetune.parallel import Layout, ParallelState, apply_tp_plan, make_slice_reader, tp_plan_for
from nxd_finetune.parallel.mappings import all_gather
from nxd_finetune.preflight.memory import layer_tensors
from nxd_finetune.recipe import load_recipe
from nxd_finetune.recipe.resume import check_resume, describe_changes
from tests.released_configs import RELEASED_CONFIGS

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = {  # conftest.tiny_hf_config overrides; 4 query heads, 2 kv heads
    "llama-gqa": ("llama", {}),
    "mistral-sliding": ("mistral", dict(sliding_window=5)),
    "gemma2": ("gemma2", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=24)),
}


def packed_rows(rows: int = 2, t: int = 96, longest: int = 12, seed: int = 0):
    """``(ids, position_ids, segment_ids)`` [rows, t] as ``data.packing.collate`` lays packed rows
    out: samples of 1..``longest`` tokens (about 15 a row) with ids 1..k and positions from 0,
    then padding (segment 0, positions from 0)."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(rows, t, dtype=torch.long)
    pos = torch.zeros(rows, t, dtype=torch.long)
    for r in range(rows):
        at, k = 0, 1
        while True:
            n = int(torch.randint(1, longest + 1, (), generator=g))
            if at + n > t - 3:
                break
            seg[r, at:at + n], pos[r, at:at + n] = k, torch.arange(n)
            at, k = at + n, k + 1
        pos[r, at:] = torch.arange(t - at)
    return torch.randint(0, 128, (rows, t), generator=g), pos, seg


def torch_flex_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                         scale: float, softcap: float | None) -> torch.Tensor:
    """torch's unfused flex attention, ``[B, heads, T, D]`` (GQA: fewer kv heads), with autograd:
    the operator ``torch.nn.attention.flex_attention`` runs when not compiled, called directly
    because the public function refuses any backward on CPU."""
    score_mod = _softcap_mod(softcap) if softcap is not None else (lambda s, b, h, qi, kv: s)
    options = _apply_kernel_options(q, k, v, False, None)
    out, _, _ = flex_operator(q, k, v, score_mod, block_mask.as_tuple(), scale, options)
    return out


def transformers_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor,
                           window: int | None, scale: float, softcap: float | None) -> torch.Tensor:
    """`transformers`' eager attention (Gemma 2's: scale, soft-cap, GQA) under its own packed-row mask
    (samples found from ``position_ids``, causal, the sliding window), ``[B, heads, T, D]`` -> tokens first."""
    b, t = position_ids.shape
    fns = [causal_mask_function, packed_sequence_mask_function(find_packed_sequence_indices(position_ids))]
    if window is not None:
        fns.append(sliding_window_overlay(window))
    idx = [torch.arange(n).view(*[n if i == d else 1 for i in range(4)]) for d, n in enumerate((b, 1, t, t))]
    allowed = and_masks(*fns)(*idx)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False)
    return eager_attention_forward(module, q, k, v, additive, scaling=scale, softcap=softcap)[0]


# (window, softcap, query_pre_attn_scalar): Llama, Mistral, Gemma 2's sliding and full layers
ATTENTION_CASES = [(None, None, None), (5, None, None), (6, 0.5, 24), (None, 0.5, 24)]


@pytest.mark.parametrize(("window", "softcap", "scalar"), ATTENTION_CASES)
def test_flex_gradients_equal_the_cpu_path_and_transformers(window, softcap, scalar):
    _, pos, seg = packed_rows()
    b, t, d = 2, seg.shape[1], 16
    scale = (scalar or d) ** -0.5
    g = torch.Generator().manual_seed(1)
    leaves = [torch.randn(b, t, h, d, generator=g, requires_grad=True) for h in (4, 2, 2)]
    grad_out = torch.randn(b, t, 4, d, generator=g)
    block_mask = flex_block_mask(seg, t, window, torch.device("cpu"))

    def run(fn) -> list[torch.Tensor]:
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad_out)]

    def flex_reference(q, k, v):
        return torch_flex_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask, scale,
                                    softcap).transpose(1, 2)

    def cpu_path(q, k, v):  # what Attention.forward runs on CPU for this layout
        layout = attention_layout(seg, t, window, torch.device("cpu"), runs=softcap is None)
        if softcap is not None:
            return _softcapped(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout, scale,
                               softcap).transpose(1, 2)
        if window is None:
            return _run_attention(q, k, v, layout.lengths, scale)
        kr, vr = (x.repeat_interleave(2, dim=2).transpose(1, 2) for x in (k, v))
        return F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=layout, scale=scale).transpose(1, 2)

    def hf(q, k, v):
        return transformers_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pos, window, scale,
                                      softcap)

    got = run(flex_reference)
    with torch.no_grad():  # the product's call (forward only on CPU) is the reference's forward
        product = flex_attention_tokens_first(*leaves, block_mask, scale if scalar else None, softcap)
    torch.testing.assert_close(product, got[0], atol=1e-6, rtol=1e-6)
    for name, fn in (("cpu path", cpu_path), ("transformers", hf)):
        for what, a, e in zip(("out", "dq", "dk", "dv"), got, run(fn), strict=True):
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=lambda m, n=name, w=what: f"{n} {w}: {m}")
    leaky = flex_block_mask(None, t, window, torch.device("cpu"))  # no segments: samples see each other
    with torch.no_grad():
        assert (flex_attention_tokens_first(*leaves, leaky, scale, softcap) - got[0]).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_flex_logits_equal_the_cpu_path_and_transformers_on_packed_rows(make_tiny_hf, name):
    family, overrides = FAMILIES[name]
    _, path = make_tiny_hf(family, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    ours = load_pretrained(path).eval()
    ids, pos, seg = packed_rows()
    keep = torch.arange(0, ids.numel(), 3)  # logits_index: the last layer's rows after attention
    with torch.no_grad():
        expected = hf(ids, position_ids=pos, use_cache=False).logits  # transformers' own packed-row mask
        default = ours(ids, pos, seg)
        ours.set_attention("flex")
        flex, flex_kept = ours(ids, pos, seg), ours(ids, pos, seg, logits_index=keep)
    torch.testing.assert_close(flex, default, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex_kept, flex.reshape(-1, flex.shape[-1])[keep], atol=1e-5, rtol=1e-5)


def test_auto_takes_flex_on_cuda_where_a_batch_needs_a_mask():
    cuda, cpu, seg = torch.device("cuda"), torch.device("cpu"), torch.ones(1, 8, dtype=torch.long)
    assert uses_flex("auto", cuda, seg, 8, None, None)
    assert uses_flex("auto", cuda, None, 8, 4, None) and uses_flex("auto", cuda, None, 8, None, 50.0)
    assert not uses_flex("auto", cuda, None, 8, None, None)  # plain causal: SDPA's is_causal kernels
    assert not uses_flex("auto", cuda, None, 8, 8, None)  # a window as long as the row is no window
    assert not uses_flex("auto", cpu, seg, 8, 4, 50.0)
    assert not uses_flex("auto", torch.device("xla"), seg, 8, None, None)
    assert not uses_flex("sdpa", cuda, seg, 8, None, None) and uses_flex("flex", cpu, None, 8, None, None)


def test_flex_refuses_a_backward_on_cpu_and_unknown_choices(make_tiny_hf):
    _, path = make_tiny_hf("llama")
    model = load_pretrained(path)
    ids, pos, seg = packed_rows(rows=1, t=16)
    model.set_attention("flex")
    with pytest.raises(NxdError, match="model.attention=flex cannot train on CPU"):
        model(ids, pos, seg)
    with pytest.raises(NxdError, match="model.attention='fast' is not one of auto, sdpa, flex"):
        model.set_attention("fast")


@pytest.mark.parametrize(("override", "culprit"), [
    ("model.attention=flex", "model.attention=flex trains on CUDA only"),
    ("model.attention=fast", "model.attention"),
])
def test_run_with_flex_on_cpu_is_one_error_line(override, culprit, tmp_path, capsys, quickstart_cache):
    recipe = ROOT / "recipes" / "quickstart.yaml"
    with pytest.raises(SystemExit) as info:
        main(["run", str(recipe), override, "training.device=cpu", "training.max_steps=1", "eval.before=false",
              "logging.progress=false", f"output.dir={tmp_path / 'out'}"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and culprit in lines[0], lines


def test_resume_applies_a_changed_attention_choice():
    """``model.attention`` changes how, not what, is computed: a resumed run may change it (the rest
    of ``model`` stays fixed), and a checkpoint whose recipe predates the key had ``auto``."""
    quickstart = ROOT / "recipes" / "quickstart.yaml"
    saved = load_recipe(quickstart, ["model.attention=sdpa"])
    changes = check_resume(saved.to_yaml(), load_recipe(quickstart, ["model.attention=flex"]), "ck/step-4", 4)
    assert describe_changes(changes, 4) == "recipe changed since the checkpoint; applied from step 5: " \
        "model.attention 'sdpa' -> 'flex'"
    older = saved.to_dict()
    del older["model"]["attention"]
    assert check_resume(yaml.safe_dump(older), load_recipe(quickstart), "ck/step-4", 4) == []
    with pytest.raises(RecipeError, match="model.dtype changed"):
        check_resume(saved.to_yaml(), load_recipe(quickstart, ["model.attention=flex", "model.dtype=bf16"]), "ck", 4)


def test_memory_estimate_has_no_soft_capped_scores_under_flex():
    """Gemma 2's soft-capped scores are kept tensors only where SDPA runs them (9B, bf16-mixed, tp 8,
    sequence parallel, 4,096 tokens, 16 heads)."""
    gemma = DecoderConfig.from_hf(RELEASED_CONFIGS["gemma-2-9b-it"])
    recipe = ROOT / "recipes" / "gemma2-9b-lora.yaml"
    sdpa, flex = (sum(layer_tensors(load_recipe(recipe, [f"model.attention={a}"]), gemma)[1]) for a in ("sdpa", "flex"))
    assert sdpa - flex == (3 * 2 + 4) * 4096 * 16 / 8


def _tp_worker(rank: int, world: int, model_dir: str) -> dict:
    """Gemma 2 (GQA, soft-capped scores, sliding and full layers) sharded on heads over ``world`` ranks,
    with and without sequence parallel: flex logits (each rank's heads) against the whole model's."""
    state = ParallelState(Layout.for_world(world, tp=world))
    config = DecoderConfig.from_hf(model_dir)
    ids, pos, seg = packed_rows(t=64)
    with torch.no_grad():
        expected = load_pretrained(model_dir)(ids, pos, seg)
    out = {}
    for sp in (False, True):
        model = apply_tp_plan(build_model(config), tp_plan_for(config), state, sequence_parallel=sp)
        materialize(model, model_dir, reader=make_slice_reader(model))
        model.set_attention("flex")
        with torch.no_grad():
            logits = all_gather(model(ids, pos, seg), -1, state.group("tp"))
        out[f"sp={sp} logits"] = ("close", logits, expected)
    return out


@pytest.mark.usefixtures("workers_tmpdir")
def test_flex_under_tensor_parallel_equals_one_process(tmp_path, make_tiny_hf):
    family, overrides = FAMILIES["gemma2"]
    _, path = make_tiny_hf(family, **overrides)
    assert assert_checks(run_world(_tp_worker, 2, tmp_path, str(path))) == 2 * 2


# ----------------------------------------------------------------------------- CUDA (skipped without a GPU)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _sgd_curve(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], steps: int) -> list[float]:
    """Losses of ``steps`` plain SGD steps on one packed batch (next-token loss within samples)."""
    ids, pos, seg = batch
    labels = ids.masked_fill(torch.diff(seg, dim=1, prepend=seg[:, :1] - 1) != 0, -100)  # no loss across samples
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        logits = model(ids, pos, seg)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2"])
def test_cuda_flex_trains_as_sdpa_in_fp32(make_tiny_hf, name):
    """On the GPU in fp32: flex (compiled) and SDPA give the same logits, gradients and a 5-step
    loss curve (<= 1e-4 relative) on packed rows of many short samples; in bf16 the logits agree
    to bf16 rounding."""
    family, overrides = FAMILIES[name]
    _, path = make_tiny_hf(family, **overrides)
    batch = tuple(x.cuda() for x in packed_rows(rows=4, t=256))
    curves, grads, logits = {}, {}, {}
    for attention in ("sdpa", "flex"):
        model = load_pretrained(path, device="cuda")
        model.set_attention(attention)
        out = model(*batch)
        out.float().square().mean().backward()
        logits[attention] = out.detach()
        grads[attention] = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        curves[attention] = _sgd_curve(model, batch, 5)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], atol=1e-4, rtol=1e-4)
    for n, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["flex"][n], g, atol=1e-4, rtol=1e-3, msg=lambda m, n=n: f"{n}: {m}")
    for a, e in zip(curves["flex"], curves["sdpa"], strict=True):
        assert math.isclose(a, e, rel_tol=1e-4), (curves["flex"], curves["sdpa"])
    bf16 = load_pretrained(path, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref = bf16(*batch).float()
        bf16.set_attention("flex")
        got = bf16(*batch).float()
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max(), (got - ref).abs().max()

"""Our decoder against the `transformers` oracle, and checkpoint loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.loss import causal_lm_loss
from nxd_finetune.models import DecoderConfig, load_pretrained, save_pretrained
from tests.model_helpers import num_parameters

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, max_position_embeddings=256)

CONFIGS = {
    "llama2": lambda: LlamaConfig(**TINY),
    "llama3-rope-scaling": lambda: LlamaConfig(
        **TINY, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama-linear-rope": lambda: LlamaConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-sliding": lambda: MistralConfig(**TINY, sliding_window=5),
    "qwen2": lambda: Qwen2Config(**TINY),
}


def make_hf(cfg, path, seed=0, **save_kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # non-trivial norms and biases so every parameter matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path, **save_kw)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    hf = make_hf(CONFIGS[name](), tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_sharded_checkpoint_and_bf16(tmp_path):
    hf = make_hf(CONFIGS["llama2"](), tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-5
    half = load_pretrained(tmp_path, dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_save_pretrained_loads_in_transformers(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    make_hf(CONFIGS["qwen2"](), src)
    ours = load_pretrained(src).eval()
    save_pretrained(ours.config, ours.state_dict().items(), out, max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and sorted(p.name for p in out.iterdir()) == sorted([*shards, "config.json",
                                                                               "model.safetensors.index.json"])
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-5
    # bf16, one shard: safetensors reads back every tensor exactly, with the "pt" metadata
    save_pretrained(ours.config, ours.state_dict().items(), tmp_path / "bf16", dtype=torch.bfloat16)
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        tied = ours.config.tie_word_embeddings
        expect = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight" or not tied}
        assert set(f.keys()) == set(expect)
        for k, v in expect.items():
            assert torch.equal(f.get_tensor(k), v.to(torch.bfloat16)), k


def test_save_pretrained_leaves_nothing_behind_on_error(tmp_path):
    make_hf(CONFIGS["llama3-rope-scaling"](), tmp_path / "src")
    ours = load_pretrained(tmp_path / "src")

    def failing():
        for i, item in enumerate(ours.state_dict().items()):
            if i == 6:
                raise RuntimeError("gather failed")
            yield item

    with pytest.raises(RuntimeError, match="gather failed"):
        save_pretrained(ours.config, failing(), tmp_path / "out", max_shard_bytes=10_000)
    assert list((tmp_path / "out").iterdir()) == []


def test_packed_batch_equals_separate_samples(tmp_path):
    make_hf(CONFIGS["llama3-rope-scaling"](), tmp_path)
    model = load_pretrained(tmp_path).eval()
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in (7, 12, 5)]
    # separately: per-token losses of each sample
    separate = []
    with torch.no_grad():
        for s in samples:
            logits = model(s[None])
            separate.append(causal_lm_loss(logits, s[None], reduction="none")[0, :-1])
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    seg = torch.cat([torch.full((len(s),), i + 1) for i, s in enumerate(samples)])[None]
    labels = ids.clone()
    starts = torch.tensor([0, 7, 19])
    labels[0, starts] = -100  # the first token of a sample is never a target of the previous one
    with torch.no_grad():
        packed = causal_lm_loss(model(ids, pos, seg), labels, reduction="none")[0]
    for s, start, ref in zip(samples, starts.tolist(), separate, strict=True):
        got = packed[start:start + len(s) - 1]
        assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    # the packed mean equals the token-weighted mean of the separate losses
    mean_sep = torch.cat(separate).mean()
    with torch.no_grad():
        assert torch.allclose(causal_lm_loss(model(ids, pos, seg), labels), mean_sep, atol=1e-6)
    # and without segment ids the answer differs: the mask is what makes it right
    with torch.no_grad():
        leaky = causal_lm_loss(model(ids, pos), labels)
    assert not torch.allclose(leaky, mean_sep, atol=1e-4)


def _record_sdpa_lengths(monkeypatch) -> list[int]:
    """The query lengths of every SDPA call the model makes from now on."""
    import torch.nn.functional as F

    from nxd_finetune.models import llama

    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, *args, **kwargs):
        seen.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", recording)
    return seen


def test_run_attention_pads_runs_and_stays_exact(monkeypatch):
    """Packed runs reach SDPA padded to a multiple of RUN_MULTIPLE tokens (a few lengths, not one per
    sample length: torch keeps state per length), and outputs and gradients equal per-segment
    causal attention through a mask."""
    import torch.nn.functional as F

    from nxd_finetune.models import llama

    lengths = [7, 70, 1, 64, 50]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, sum(lengths), heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for heads in (4, 2, 2))
    sdpa = F.scaled_dot_product_attention
    seen = _record_sdpa_lengths(monkeypatch)
    out = llama._run_attention(q, k, v, lengths)
    monkeypatch.undo()
    assert seen == [64, 128, 64, 64, 64] and all(n % llama.RUN_MULTIPLE == 0 for n in seen)
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    mask = llama.attention_mask(seg, sum(lengths), None, torch.device("cpu"))
    ref = sdpa(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
               attn_mask=mask).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, exp in zip(grads, want, strict=True):
        assert torch.allclose(got, exp, atol=1e-12)


def test_unpacked_cpu_attention_is_padded(tmp_path, monkeypatch):
    """Unpacked batches (T = the longest row, different every batch) reach SDPA padded to
    RUN_MULTIPLE on CPU too, with the logits of transformers."""

    from nxd_finetune.models import llama

    hf = make_hf(CONFIGS["llama2"](), tmp_path)
    ours = load_pretrained(tmp_path).eval()
    seen = _record_sdpa_lengths(monkeypatch)
    ids = torch.randint(0, 128, (2, 10))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-5
    assert seen and set(seen) == {llama.RUN_MULTIPLE}


def test_missing_tensor_is_named(tmp_path):
    make_hf(CONFIGS["llama2"](), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_pretrained(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    make_hf(CONFIGS["llama2"](), tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"k_proj\.weight.*\(8, 64\).*\(32, 64\)"):
        load_pretrained(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        DecoderConfig.from_hf(tmp_path)


def test_missing_checkpoint_files(tmp_path):
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_pretrained(tmp_path)


def test_parameter_count_matches_transformers():
    for name, make in CONFIGS.items():
        cfg = make()
        hf = AutoModelForCausalLM.from_config(cfg)
        ours = DecoderConfig.from_hf(json.loads(cfg.to_json_string()) | {"architectures": [type(hf).__name__]})
        assert num_parameters(ours) == sum(p.numel() for p in hf.parameters()), name


def _packed_batch(g):
    """Two packed rows: samples of 7+12+5 tokens, then 9+10 and 5 tokens of padding (segment 0)."""
    rows = [(7, 12, 5), (9, 10)]
    ids = torch.randint(0, 128, (2, 24), generator=g)
    pos, seg = torch.zeros(2, 24, dtype=torch.long), torch.zeros(2, 24, dtype=torch.long)
    for r, lengths in enumerate(rows):
        t = 0
        for k, n in enumerate(lengths, start=1):
            pos[r, t:t + n], seg[r, t:t + n] = torch.arange(n), k
            t += n
        pos[r, t:] = torch.arange(24 - t)
    return ids, pos, seg


def test_per_sample_attention_equals_the_segment_mask(tmp_path, monkeypatch):
    """On CPU, packed rows take the per-run attention path; it must equal the boolean-mask path,
    in values and gradients, padding included."""
    from nxd_finetune.models import llama

    make_hf(CONFIGS["llama2"](), tmp_path)
    model = load_pretrained(tmp_path)
    ids, pos, seg = _packed_batch(torch.Generator().manual_seed(4))
    assert llama.segment_runs(seg).lengths == [7, 12, 5, 9, 10, 5]
    assert llama.segment_runs(torch.tensor([[1, 1, 2, 1]])) is None  # a repeated id needs the mask

    def run():
        model.zero_grad()
        logits = model(ids, pos, seg)
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    got, got_grads = run()
    monkeypatch.setattr(llama, "segment_runs", lambda s: None)  # force the mask path
    ref, ref_grads = run()
    assert (got - ref).abs().max() <= 1e-5
    for a, b in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["runs", "mask", "causal"])
def test_loss_at_targets_equals_full_logits_loss(tmp_path, monkeypatch, layout):
    """Logits at target positions only (the last layer's o_proj/MLP on those rows only) give the
    full-logits loss and gradients, for packed rows (per-sample runs or the mask) and plain rows."""
    from nxd_finetune.loss import ce_sum, target_index
    from nxd_finetune.models import llama

    def causal_lm_loss_at_targets(model, batch, reduction):  # what Engine.logits_and_targets + ce_sum do
        index, targets = target_index(batch["labels"])
        logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"], logits_index=index)
        loss = ce_sum(logits, targets)
        return loss if reduction == "sum" else loss / max(1, int((targets != -100).sum()))  # targets: padded rows

    make_hf(CONFIGS["llama2"](), tmp_path)
    model = load_pretrained(tmp_path)
    ids, pos, seg = _packed_batch(torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt
    labels[seg == 0] = -100
    if layout == "mask":
        monkeypatch.setattr(llama, "segment_runs", lambda s: None)
    if layout == "causal":
        pos = seg = None
    batch = {"input_ids": ids, "position_ids": pos, "segment_ids": seg, "labels": labels}
    grads = []
    for loss_fn in (lambda: causal_lm_loss(model(ids, pos, seg), labels, reduction="sum"),
                    lambda: causal_lm_loss_at_targets(model, batch, reduction="sum")):
        model.zero_grad()
        loss = loss_fn()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    mean = causal_lm_loss_at_targets(model, batch, reduction="mean")
    assert torch.allclose(mean, causal_lm_loss(model(ids, pos, seg), labels), rtol=1e-6)


def test_swiglu_recomputes_silu_with_the_same_gradients():
    """The MLP's fused ``silu(gate) * up`` (silu recomputed in backward) against autograd's ops."""
    from nxd_finetune.models.llama import _SwiGLU

    g = torch.Generator().manual_seed(6)
    gate = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLU.apply, (gate, up))
    grad = torch.randn(5, 7, dtype=torch.float64, generator=g)
    ref = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), grad)
    got = torch.autograd.grad(_SwiGLU.apply(gate, up), (gate, up), grad)
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def test_short_packed_rows_take_one_masked_call(tmp_path, monkeypatch):
    """Short packed rows whose padded runs would cost more than the rows' full mask go through one
    masked SDPA call per layer (not one per run: issue 46), with each sample's logits equal to
    transformers' on that sample alone; long rows of long samples keep the runs."""
    from nxd_finetune.models.attention import SegmentRuns, attention_layout, cheaper_layout

    hf = make_hf(CONFIGS["llama2"](), tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids, pos, seg = _packed_batch(torch.Generator().manual_seed(7))
    seen = _record_sdpa_lengths(monkeypatch)
    with torch.no_grad():
        logits = ours(ids, pos, seg)
        for r, row in enumerate(seg):
            for s in row.unique().tolist():
                if s:
                    at = (row == s).nonzero().squeeze(1)
                    want = hf(ids[r:r + 1, at]).logits[0]
                    assert (logits[r, at] - want).abs().max() <= 1e-5
    assert seen == [24, 24]  # one call per layer over the rows' 24 tokens
    long = torch.cat([torch.full((150,), i) for i in (1, 2, 3)] + [torch.full((62,), 4)])[None]
    layout = cheaper_layout(attention_layout(long, 512, None, torch.device("cpu")), long, 512, torch.device("cpu"))
    assert isinstance(layout, SegmentRuns) and layout.lengths == [150, 150, 150, 62]

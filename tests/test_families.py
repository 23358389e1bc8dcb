"""The families beyond Llama (Qwen3, Qwen2.5's released shapes) against the `transformers` oracle:
logits in fp32 (HF's eager and sdpa attention), packed rows against separate rows, LoRA adapters
loaded by `peft`, parameter counts of the released configs (against `transformers` and the counts
their publishers state), and the shipped recipes through ``validate`` against those configs
(weights files that hold only headers, no data). The released configs, and the public copy each
was checked against, are in ``tests/released_configs.py``."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from nxd_finetune.cli import main
from nxd_finetune.errors import NxdError
from nxd_finetune.lora import LoraConfig, inject_lora, save_adapter
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained
from nxd_finetune.parallel.plan import check_tp_config
from nxd_finetune.preflight.memory import layer_tensors
from nxd_finetune.recipe import load_recipe
from tests.model_helpers import NO_SDPA, TINY_FAMILIES, num_parameters, write_header_only_checkpoint
from tests.released_configs import PUBLISHED_NON_EMBEDDING_B, PUBLISHED_PARAMETERS, RELEASED_CONFIGS

REPO = Path(__file__).resolve().parents[1]


def _tiny(make_tiny_hf, name: str, seed: int = 0):
    family, overrides = TINY_FAMILIES[name]
    return make_tiny_hf(family, seed=seed, **overrides)


def _ids(b: int = 2, t: int = 40, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_logits_match_transformers(make_tiny_hf, name, attn):
    if attn == "sdpa" and name.startswith(NO_SDPA):
        pytest.skip("transformers refuses sdpa for this family")
    _, path = _tiny(make_tiny_hf, name)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
    ours = load_pretrained(path).eval()
    ids = _ids()
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("length", [12, 16, 17])
def test_longrope_short_and_long_factors_match_transformers(make_tiny_hf, length):
    """Up to original_max_position_embeddings (16) the short factors, past it the long ones."""
    _, path = _tiny(make_tiny_hf, "phi3-longrope")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_pretrained(path).eval()
    ids = _ids(t=length)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff
    assert ours.model.rope.scale > 1.0  # sqrt(1 + log(64 / 16) / log(16))


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "phi3", "gemma2", "gemma3"])
def test_packed_rows_equal_separate_rows(make_tiny_hf, name):
    """Three samples packed in one row (per-sample causal runs, and the boolean mask the
    accelerators take) give each sample's logits as alone."""
    _, path = _tiny(make_tiny_hf, name)
    model = load_pretrained(path).eval()
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in (7, 12, 5)]
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    seg = torch.cat([torch.full((len(s),), i + 1) for i, s in enumerate(samples)])[None]
    seg_repeat = seg.clone()
    seg_repeat[0, -5:] = 1  # a repeated id: only the mask can say it, so this takes the mask path
    with torch.no_grad():
        packed = model(ids, pos, seg)[0]
        alone = torch.cat([model(s[None])[0] for s in samples])
        masked = model(ids[:, :-5], pos[:, :-5], seg_repeat[:, :-5])[0]
        leaky = model(ids, pos)[0]
    assert (packed - alone).abs().max() <= 1e-5
    assert (masked - alone[:-5]).abs().max() <= 1e-5
    assert (leaky - alone).abs().max() > 1e-3  # without segment ids the samples see each other


LLAMA_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
PHI_LINEARS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


@pytest.mark.parametrize(("name", "targets", "expected"), [
    ("qwen3", "all-linear", LLAMA_LINEARS),
    ("qwen3-tied", "all-linear", LLAMA_LINEARS),
    ("phi3", "all-linear", PHI_LINEARS),
    ("phi3-partial-rotary", ["qkv_proj", "gate_up_proj"], {"qkv_proj", "gate_up_proj"}),
    ("qwen2.5-tied", "all-linear", LLAMA_LINEARS),
    ("mistral-sliding", "all-linear", LLAMA_LINEARS),
    ("gemma2", "all-linear", LLAMA_LINEARS),
    ("gemma3", "all-linear", LLAMA_LINEARS),
])
def test_lora_adapter_loads_in_peft_with_our_logits(make_tiny_hf, tmp_path, name, targets, expected):
    """LoRA (HF module names) with random B (a trained adapter), saved by us, loaded by `peft` on
    the `transformers` model: the same logits."""
    _, path = _tiny(make_tiny_hf, name)
    ours = load_pretrained(path).eval()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    assert {t.rpartition(".")[2] for t in inject_lora(ours, cfg)} == expected
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_adapter(ours, cfg, tmp_path / "adapter", str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _ids()
    with torch.no_grad():
        base = hf(ids).logits
        ref = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(ids).logits
        diff = (ours(ids) - ref).abs().max().item()
    assert diff <= 1e-5, diff
    assert (base - ref).abs().max() > 1e-3  # the adapter changes the logits


@pytest.mark.parametrize("name", sorted(RELEASED_CONFIGS))
def test_parameter_counts_equal_transformers(name):
    """Ours from the shapes, ours from a meta build, and `transformers`' meta build agree, and equal
    the count the checkpoint's publisher states (its safetensors total; the model card's figure
    without embeddings where the card prints one), so a wrong shape in the config fails here."""
    raw = RELEASED_CONFIGS[name]
    config = DecoderConfig.from_hf(raw)
    hf_config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in hf.parameters())
    assert expected == PUBLISHED_PARAMETERS[name]
    if name in PUBLISHED_NON_EMBEDDING_B:
        embeddings = hf.get_input_embeddings().weight.numel() * (1 if hf_config.tie_word_embeddings else 2)
        assert round((expected - embeddings) / 1e9, 2) == PUBLISHED_NON_EMBEDDING_B[name]
    assert num_parameters(config) == expected
    assert sum(p.numel() for p in build_model(config).parameters()) == expected
    tied = config.tie_word_embeddings
    assert sorted(n for n in build_model(config).state_dict() if n != "lm_head.weight" or not tied) \
        == sorted(n for n in hf.state_dict() if n != "lm_head.weight" or not tied)


# recipe -> (released config it targets, LoRA trainable parameters computed by hand)
SHIPPED = {
    "qwen3-8b-lora": ("Qwen3-8B",
                      36 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 12288) * 3)),
    # qkv_proj 5120 -> 40*128 + 2*10*128, o_proj, gate_up_proj 5120 -> 2*17920, down_proj
    "phi4-lora": ("phi-4", 40 * 16 * ((5120 + 7680) + (5120 + 5120) + (5120 + 35840) + (17920 + 5120))),
    # q 3584 -> 16*256, k/v 3584 -> 8*256, o, gate/up 3584 -> 14336, down
    "gemma2-9b-lora": ("gemma-2-9b-it", 42 * 16 * ((3584 + 4096) * 2 + (3584 + 2048) * 2 + (3584 + 14336) * 3)),
    # q 1152 -> 4*256, k/v 1152 -> 256, o, gate/up 1152 -> 6912, down
    "gemma3-1b-lora": ("gemma-3-1b-it", 26 * 16 * ((1152 + 1024) * 2 + (1152 + 256) * 2 + (1152 + 6912) * 3)),
}


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_shipped_recipe_validates_against_the_released_config(capsys, tmp_path, quickstart_cache, recipe):
    real, lora_trainable = SHIPPED[recipe]
    model = write_header_only_checkpoint(tmp_path / real, RELEASED_CONFIGS[real])
    data = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["validate", str(REPO / "recipes" / f"{recipe}.yaml"), f"model.path={model}", f"data.train={data}",
              f"data.eval={data}"])
    out = capsys.readouterr()
    assert (info.value.code or 0) == 0, out.err
    total, trainable = (int(x.replace(",", "")) for x in
                        re.search(r"parameters: total ([\d,]+)\s+trainable ([\d,]+)", out.out).groups())
    assert trainable == lora_trainable
    assert total == num_parameters(DecoderConfig.from_hf(RELEASED_CONFIGS[real])) + lora_trainable


def test_gemma3_config_written_before_transformers_5(make_tiny_hf):
    """Released Gemma 3 configs predate ``layer_types`` and per-layer-type ``rope_parameters``:
    ``rope_theta`` + ``rope_scaling`` (full layers), ``rope_local_base_freq`` (sliding layers) and
    ``sliding_window_pattern``. Read the same way transformers converts them: equal logits."""
    _, path = _tiny(make_tiny_hf, "gemma3-linear-rope")
    raw = json.loads((path / "config.json").read_text())
    rope = raw.pop("rope_parameters")
    raw.pop("layer_types")
    raw.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling={"rope_type": "linear", "factor": 8.0},
               rope_local_base_freq=rope["sliding_attention"]["rope_theta"], sliding_window_pattern=3)
    (path / "config.json").write_text(json.dumps(raw))
    config = DecoderConfig.from_hf(path)
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] * 2
    assert (config.rope_theta, config.rope_local_base_freq, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == config.layer_types
    ours = load_pretrained(path).eval()
    ids = _ids()
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-5


def test_memory_estimate_counts_gemma_tensors():
    """Gemma 2's two extra norms and its soft-capped (unfused) attention scores are in the per-token
    activations ``validate`` counts: bf16-mixed over a bf16 base (2-byte widths), tp 8, sequence
    parallel, 4,096 tokens, 16 heads."""
    recipe = load_recipe(REPO / "recipes" / "gemma2-9b-lora.yaml", ["model.attention=sdpa"])  # flex caps in-kernel
    gemma = DecoderConfig.from_hf(RELEASED_CONFIGS["gemma-2-9b-it"])
    plain = dataclasses.replace(gemma, sandwich_norms=False, attn_logit_softcapping=None)
    extra = sum(layer_tensors(recipe, gemma)[1]) - sum(layer_tensors(recipe, plain)[1])  # recomputed (full AC)
    assert extra == 2 * 2 * 3584 / 8 + (3 * 2 + 4) * 4096 * 16 / 8


def test_fused_qkv_refuses_replicated_kv_heads():
    """A fused qkv_proj is split by head; KV heads cannot be replicated over more tp ranks than
    there are of them (Phi-4: 10 KV heads; with its 100,352-token vocabulary only tp 2 splits it):
    one line naming the numbers."""
    phi4 = DecoderConfig.from_hf(RELEASED_CONFIGS["phi-4"])
    check_tp_config(phi4, 2)
    with pytest.raises(NxdError, match=r"^num_key_value_heads=10 is not divisible by tp=20 \(a fused qkv_proj"):
        check_tp_config(phi4, 20)

"""The families beyond Llama (Qwen3, Qwen2.5's released shapes) against the `transformers` oracle:
logits in fp32 (HF's eager and sdpa attention), packed rows against separate rows, LoRA adapters
loaded by `peft`, parameter counts of the released configs, and the shipped recipes through
``validate`` against those configs (weights files that hold only headers, no data)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from nxd_finetune.cli import main
from nxd_finetune.lora import LoraConfig, inject_lora, save_adapter
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained
from nxd_finetune.safetensors_io import header_bytes

REPO = Path(__file__).resolve().parents[1]

# family -> tiny transformers config overrides (conftest.tiny_hf_config); head_dim set apart from
# hidden / heads where the family allows it
TINY_FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3-tied": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
    "qwen2.5-tied": ("qwen2", dict(tie_word_embeddings=True)),
}

# config.json of released checkpoints (the fields that define the model, as published)
REAL_CONFIGS = {
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936},
    "Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936},
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936},
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
        "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 152064},
}


def _tiny(make_tiny_hf, name: str, seed: int = 0):
    family, overrides = TINY_FAMILIES[name]
    return make_tiny_hf(family, seed=seed, **overrides)


def _ids(b: int = 2, t: int = 40, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_logits_match_transformers(make_tiny_hf, name, attn):
    _, path = _tiny(make_tiny_hf, name)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
    ours = load_pretrained(path).eval()
    ids = _ids()
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied"])
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


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied"])
def test_lora_adapter_loads_in_peft_with_our_logits(make_tiny_hf, tmp_path, name):
    """``all-linear`` LoRA with random B (a trained adapter), saved by us, loaded by `peft` on the
    `transformers` model: the same logits."""
    from peft import PeftModel

    _, path = _tiny(make_tiny_hf, name)
    ours = load_pretrained(path).eval()
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    targets = inject_lora(ours, cfg)
    assert {t.rpartition(".")[2] for t in targets} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"}
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


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_parameter_counts_equal_transformers(name):
    """Ours from the shapes, ours from a meta build, and `transformers`' meta build agree."""
    raw = REAL_CONFIGS[name]
    config = DecoderConfig.from_hf(raw)
    hf_config = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in hf.parameters())
    assert config.num_parameters() == expected
    assert sum(p.numel() for p in build_model(config).parameters()) == expected
    tied = config.tie_word_embeddings
    assert sorted(n for n in build_model(config).state_dict() if n != "lm_head.weight" or not tied) \
        == sorted(n for n in hf.state_dict() if n != "lm_head.weight" or not tied)


def write_header_only_checkpoint(path: Path, raw: dict) -> Path:
    """``config.json`` and a ``model.safetensors`` whose header names every tensor with its shape
    and whose data region is a hole (a sparse file: no weights written or stored), plus the
    quickstart tokenizer. Enough for ``validate``, which reads headers only."""
    from nxd_finetune.quickstart import ensure_tiny_model

    path.mkdir(parents=True)
    config = DecoderConfig.from_hf(raw)
    entries = [(n, torch.bfloat16, tuple(t.shape)) for n, t in build_model(config).state_dict().items()
               if n != "lm_head.weight" or not config.tie_word_embeddings]
    header = header_bytes(entries, {"format": "pt"})
    with open(path / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(2 * torch.Size(s).numel() for _, _, s in entries))
    (path / "config.json").write_text(json.dumps(raw))
    for f in ensure_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


# recipe -> (released config it targets, LoRA trainable parameters computed by hand)
SHIPPED = {
    "qwen3-8b-lora": ("Qwen3-8B",
                      36 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 12288) * 3)),
}


@pytest.mark.parametrize("recipe", sorted(SHIPPED))
def test_shipped_recipe_validates_against_the_released_config(capsys, tmp_path, quickstart_cache, recipe):
    real, lora_trainable = SHIPPED[recipe]
    model = write_header_only_checkpoint(tmp_path / real, REAL_CONFIGS[real])
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
    assert total == DecoderConfig.from_hf(REAL_CONFIGS[real]).num_parameters() + lora_trainable

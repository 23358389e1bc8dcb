"""The family records (nxd_finetune/models/families.py) against transformers: each record's names
are transformers' own, a config without ``architectures`` is read by its ``model_type``, and each
record's TP plan places every parameter of the family's model exactly once."""

from __future__ import annotations

import fnmatch

import pytest
from conftest import tiny_hf_config
from torch import nn
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.models import FAMILIES, DecoderConfig, build_model
from nxd_finetune.models.families import MULTIMODAL
from nxd_finetune.parallel.plan import STYLES, tp_plan_for
from tests.moe_helpers import MOE_FAMILIES, tiny_moe_config

TINY_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
               "Gemma3ForCausalLM": "gemma3"}


def _tiny_config(arch: str):
    """The tiny transformers config of ``arch``'s family (the mixture-of-experts ones from moe_helpers)."""
    return tiny_moe_config(MOE_FAMILIES[arch]) if arch in MOE_FAMILIES else tiny_hf_config(TINY_FAMILY[arch])


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_records_use_transformers_names(arch):
    family = FAMILIES[arch]
    assert MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family.model_type] == arch
    assert family.model_type in CONFIG_MAPPING
    hf = _tiny_config(arch).to_dict()
    assert hf["model_type"] == family.model_type
    hf.pop("architectures", None)  # read by model_type alone
    assert DecoderConfig.from_hf(hf).architecture == arch
    for name, value in family.flags.items():
        assert getattr(DecoderConfig.from_hf(hf), name) == value, name


def test_multimodal_records_use_transformers_names():
    for arch, record in MULTIMODAL.items():
        assert MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[record.model_type] == arch
        assert record.text_architecture in FAMILIES


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_each_plan_places_every_parameter_once(arch):
    """Every linear, embedding and norm of the family's model matches exactly one pattern of its
    plan, with a known style; no pattern matches nothing."""
    config = DecoderConfig.from_hf(_tiny_config(arch).to_dict())
    plan = tp_plan_for(config)
    assert set(plan.values()) <= set(STYLES)
    model = build_model(config, device="meta")
    used: set[str] = set()
    for name, module in model.named_modules():
        if not any(p is not None for p in module._parameters.values()):
            continue
        hits = [pattern for pattern in plan if fnmatch.fnmatchcase(name, pattern.replace("*", "[0-9]*"))]
        if isinstance(module, (nn.Linear, nn.Embedding)) or name.endswith("norm") or "layernorm" in name:
            assert len(hits) == 1, (name, hits)
        used.update(hits)
    if config.tie_word_embeddings:
        used.add("lm_head")
    assert used == set(plan), set(plan) - used


def test_unknown_architectures_are_one_line():
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        DecoderConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(NxdError, match="no tensor-parallel plan for 'GPT2LMHeadModel'; supported: LlamaForCausalLM"):
        tp_plan_for(type("C", (), {"architecture": "GPT2LMHeadModel"})())

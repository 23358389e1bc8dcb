"""The shipped mixture-of-experts recipes (``recipes/qwen3-30b-a3b-lora.yaml``,
``recipes/mixtral-8x7b-lora.yaml``) through ``validate`` against the released configs
(``tests/released_configs.py``, with their sources) in checkpoints of the Hub's per-expert keys
whose weights are holes: the parameter counts (total, LoRA trainable by hand, experts, active per
token as the publishers state it) and a memory estimate that fits the GPU each recipe names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nxd_finetune.cli import main
from nxd_finetune.models import DecoderConfig
from tests.model_helpers import num_parameters, write_header_only_checkpoint
from tests.moe_helpers import doc_commands
from tests.released_configs import RELEASED_CONFIGS

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
# recipe -> (released config, LoRA trainable parameters by hand, active parameters per token in billions
# as the publisher states them, GiB of the GPU the recipe names: an 80 GB H100's 79.6, a 141 GB H200's 139.8)
MOE_RECIPES = {
    # per layer, r = 16: q 2048 -> 32*128, k/v 2048 -> 4*128, o; the experts' fused tensors (PEFT's
    # target_parameters: lora_A [r*E, in], lora_B [out, r*E]), E = 128: gate_up 2048 -> 2*768, down 768 -> 2048.
    # 3.3B active: the model card and keras-hub's preset description
    "qwen3-30b-a3b-lora": ("Qwen3-30B-A3B",
                           48 * 16 * ((2048 + 4096) * 2 + (2048 + 512) * 2 + 128 * ((2048 + 1536) + (768 + 2048))),
                           3.3, 79),
    # q 4096 -> 32*128, k/v 4096 -> 8*128, o; E = 8: gate_up 4096 -> 2*14336, down 14336 -> 4096.
    # 12.9B active: Mistral AI's Mixtral announcement ("uses 12.9B parameters per token")
    "mixtral-8x7b-lora": ("Mixtral-8x7B-v0.1",
                          32 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2 + 8 * ((4096 + 28672) + (14336 + 4096))),
                          12.9, 139),
}


def test_the_docs_show_the_moe_commands():
    """Every command docs/models.md shows is one this file or test_quickstart_moe.py runs."""
    assert set(doc_commands()) == {"nxd-finetune run builtin:quickstart-moe",
                                   *(f"nxd-finetune validate recipes/{r}.yaml" for r in MOE_RECIPES)}


@pytest.mark.parametrize("recipe", sorted(MOE_RECIPES))
def test_moe_recipe_validates_against_the_released_config(capsys, tmp_path, quickstart_cache, recipe):
    """The docs' ``validate`` line of the recipe, the model and data paths overridden."""
    real, lora_trainable, active_b, gpu_gib = MOE_RECIPES[recipe]
    argv = doc_commands()[f"nxd-finetune validate recipes/{recipe}.yaml"]
    raw = RELEASED_CONFIGS[real]
    model = write_header_only_checkpoint(tmp_path / real, raw)
    keys = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(".experts.gate_up_proj" in k for k in keys)  # the Hub's layout: one tensor per expert
    data = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    with pytest.raises(SystemExit) as info:
        main([argv[1], str(REPO / argv[2]), f"model.path={model}", f"data.train={data}", f"data.eval={data}",
              "--json"])
    out = capsys.readouterr()
    assert (info.value.code or 0) == 0, out.err
    report = json.loads(out.out)
    counts = report["parameters"]
    assert counts["trainable"] == lora_trainable
    assert counts["total"] == num_parameters(DecoderConfig.from_hf(raw)) + lora_trainable
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    width = raw.get("moe_intermediate_size", raw["intermediate_size"])
    assert counts["experts"] == raw["num_hidden_layers"] * experts * 3 * raw["hidden_size"] * width
    active = (counts["active_per_token"] - lora_trainable) / 1e9  # the base's: 3.35 and 12.88
    assert active_b in (round(active, 1), math.floor(active * 10) / 10)  # Qwen's "3.3B" cuts 3.35 short
    memory = report["memory_per_rank_bytes"]
    assert memory["total"] < gpu_gib * GiB, memory

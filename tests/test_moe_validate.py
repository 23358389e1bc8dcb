"""``nxd-finetune validate`` on a mixture-of-experts model: the parameter counts (total as
transformers' model has them, the expert parameters and those one token runs) and the memory
estimate's expert terms (weights: the real parameter bytes; activations: the top-k routed copies)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from nxd_finetune.preflight.memory import layer_tensors
from nxd_finetune.preflight.report import print_report, report_json, run_checks
from nxd_finetune.recipe import load_recipe
from tests.moe_helpers import QUICKSTART, moe_with_tokenizer  # noqa: F401  (a fixture)


def test_validate_counts_experts_and_estimates_them(moe_with_tokenizer, capsys):  # noqa: F811
    recipe = load_recipe(QUICKSTART, [f"model.path={moe_with_tokenizer}", "lora=null", "data.max_seq_len=64",
                                      "training.micro_batch_size=2", "parallel.activation_checkpointing=none"])
    result = run_checks(recipe)
    hf = AutoModelForCausalLM.from_pretrained(moe_with_tokenizer).float()
    params = list(hf.parameters())
    report = report_json(result)["parameters"]
    assert report["total"] == sum(p.numel() for p in params)
    # by hand: 2 layers, layer 0 MoE (6 experts of width 32, top 2), layer 1 dense; H = 64
    experts = hf.model.layers[0].mlp.experts
    assert report["experts"] == 6 * 3 * 64 * 32 == experts.gate_up_proj.numel() + experts.down_proj.numel()
    assert report["active_per_token"] == report["total"] - 4 * 3 * 64 * 32
    # fp32 full fine-tuning: the weights are the parameters' bytes
    assert result.memory["weights"] == sum(p.numel() * p.element_size() for p in params)
    # activations per token: the MoE layer keeps its 2 routed copies' tensors, not a dense MLP of width 96
    kept, _ = layer_tensors(recipe, result.config)
    attention = 2 * 4 * 64 + 4 * 64 + 3 * 4 * 64 + 2 * 4 * 32 + 2 * 4 * 64 + 4 * 64 + 4 * 32  # qk norms, fp32 norms
    moe = 4 * 64 + 8 * 6 + 2 * (4 * 64 + 3 * 4 * 32 + 4 * 64)
    dense = 4 * 64 + 3 * 4 * 96
    torch.testing.assert_close(sum(kept), float(attention + (moe + dense) / 2), rtol=1e-9, atol=0)
    print_report(result)
    out = capsys.readouterr().out
    assert f"experts: {report['experts']:,} parameters (6 per MoE layer, 2 per token)" in out

"""``nxd-finetune validate`` on a mixture-of-experts model: the parameter counts (total as
transformers' model has them, the expert parameters and those one token runs) and the memory
estimate's expert terms (weights: the real parameter bytes; activations: the top-k routed copies)."""

from __future__ import annotations

import pytest
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


def test_validate_estimates_each_ranks_experts_under_ep_and_a_bad_ep_is_one_line(moe_with_tokenizer, capsys):  # noqa: F811
    """Full fine-tuning in fp32: at ep2 a rank holds 3 of the 6 experts (their weights, gradients and
    AdamW states halve); under tp the experts stay whole on every rank (only the dense parts halve).
    An ep that does not divide dp or the expert count is one line from ``validate``."""
    from nxd_finetune.errors import RecipeError
    from tests.cli_run import run_cli

    base = [f"model.path={moe_with_tokenizer}", "lora=null", "data.max_seq_len=64", "training.micro_batch_size=2",
            "parallel.activation_checkpointing=none"]
    dp2, ep2, tp2 = (run_checks(load_recipe(QUICKSTART, [*base, *extra])) for extra in (
        ["parallel.nproc=2"], ["parallel.nproc=2", "parallel.ep=2"], ["parallel.nproc=2", "parallel.tp=2"]))
    report = report_json(dp2)["parameters"]
    experts, total = report["experts"], report["total"]
    assert dp2.memory["weights"] - ep2.memory["weights"] == experts * 4 / 2
    assert dp2.memory["gradients"] - ep2.memory["gradients"] == experts * 4 / 2
    assert dp2.memory["optimizer"] - ep2.memory["optimizer"] == experts * 8 / 2
    assert tp2.memory["weights"] == (total - experts) * 4 / 2 + experts * 4
    with pytest.raises(RecipeError, match=r"^parallel.ep=4 does not divide the model's 6 experts$"):
        run_checks(load_recipe(QUICKSTART, [*base, "parallel.nproc=4", "parallel.ep=4"]))
    for extra, message in ((["parallel.nproc=4", "parallel.ep=3"],
                            "parallel.ep=3 does not divide the data-parallel degree dp=4"),
                           (["parallel.nproc=4", "parallel.ep=4"],
                            "parallel.ep=4 does not divide the model's 6 experts"),
                           (["parallel.nproc=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
                            "parallel.sequence_parallel on a mixture-of-experts model")):
        capsys.readouterr()
        code, _, err = run_cli(capsys, "validate", str(QUICKSTART), *base, *extra)
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (code, err)

"""GRPO's KL reference when the run starts from an adapter (``lora.init_from``), checked against
transformers + peft: ``init_from`` (the default with ``lora.init_from``, TRL's frozen copy of a
``PeftModel``'s adapter; tests/test_grpo_trl.py compares the whole run with TRL) gives the starting
adapter's log-probs, ``base`` the base model's, also after the policy has trained, with no second
model (the source's reference is the engine's own weights swapped); the adapter records which."""

from __future__ import annotations

import functools

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from nxd_finetune.loss import IGNORE_INDEX, shift_labels
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.rl.source import GRPOSource, grpo_source, token_logps
from nxd_finetune.sft.setup import setup_rank
from nxd_finetune.sft.step import train_step
from nxd_finetune.sft.trainer import objective_metadata
from tests.rl_helpers import fixed, grpo_recipe, start_adapter

TEMPERATURE = 0.8


def hf_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` log-probs of the batch's targets at their predicting positions (0 elsewhere), of
    the logits over the temperature, as the source lays out ``ref_logps``."""
    targets = shift_labels(batch["labels"])
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits.float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return torch.where(targets != IGNORE_INDEX, logp, 0.0)


@pytest.mark.parametrize("reference", [None, "init_from", "base"])
def test_reference_is_the_starting_adapter_or_the_base(reference, make_tiny_hf, tmp_path):
    _, model_dir = make_tiny_hf("llama")
    adapter = tmp_path / "start"
    start_adapter(model_dir, adapter, trained=True)
    d = grpo_recipe(tmp_path, model_dir, tmp_path / "out", 2, {"micro_batch_size": 4, "grad_accum": 2},
                    num_iterations=1, temperature=TEMPERATURE, beta=0.1,
                    **({"reference": reference} if reference else {}))
    d["lora"]["init_from"] = str(adapter)
    recipe = recipe_from_dict(d)
    kind = reference or "init_from"
    assert objective_metadata(recipe)["nxd_reference"] == ("base" if kind == "base" else f"init_from:{adapter}")
    rr = setup_rank(recipe, device=torch.device("cpu"), write_recipe=False,
                    source=functools.partial(grpo_source, generate=fixed))
    source, engine = rr.source, rr.engine
    assert isinstance(source, GRPOSource)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    started = peft.PeftModel.from_pretrained(hf, adapter).eval()  # the adapter the run starts from

    def expected(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if kind == "init_from":
            return hf_logps(started, batch)
        with started.disable_adapter():
            return hf_logps(started, batch)

    engine.train(True)
    first, n_input = source.next_step(engine, 1)
    for b in first:
        torch.testing.assert_close(b["ref_logps"], expected(b), atol=1e-5, rtol=1e-5)
        with started.disable_adapter():
            base = hf_logps(started, b)
        assert (hf_logps(started, b) - base).abs().max() > 1e-2  # the two references differ here
    train_step(engine, first, n_input, objective=rr.objective)
    # the next generation, after a step: still the starting adapter (or the base), not the policy now
    for b in source.next_step(engine, 2)[0]:
        torch.testing.assert_close(b["ref_logps"], expected(b), atol=1e-5, rtol=1e-5)
        assert (token_logps(engine, b, TEMPERATURE) - hf_logps(started, b)).abs().max() > 1e-4  # the policy moved

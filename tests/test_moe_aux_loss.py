"""The router auxiliary loss in training (``output_router_logits``): one step of the engine on a
tiny Qwen3-MoE / Mixtral has transformers' loss (token-mean cross entropy + ``router_aux_loss_coef``
x ``aux_loss``) and its ``loss.backward()`` gradients; with two micro-batches each adds its share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxd_finetune.lora import base_param_name
from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.objective import SFT
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft.engine import Engine, build_engine
from tests.moe_helpers import QUICKSTART, build_tiny_moe, moe_with_tokenizer, tiny_moe_config, train  # noqa: F401  (a fixture)


def _engine(path: Path) -> Engine:
    recipe = load_recipe(QUICKSTART, [f"model.path={path}", "lora=null", "training.warmup_steps=0"])
    return build_engine(recipe, path, torch.device("cpu"), 2)


def _batch(seed: int, rows: int = 2, t: int = 20, pad: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` random rows, the first 6 tokens a prompt; ``pad``: each row's last ``pad`` tokens are
    padding (segment 0, as the loader pads packed rows)."""
    ids = torch.randint(0, 128, (rows, t), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # a prompt: routed (aux) but no loss
    if not pad:
        return {"input_ids": ids, "labels": labels}
    segments = torch.ones_like(ids)
    segments[:, t - pad:] = 0
    labels[:, t - pad:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "segment_ids": segments}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_step_with_aux_loss_equals_transformers(tmp_path, family):
    path = tmp_path / family
    hf = build_tiny_moe(tiny_moe_config(family, output_router_logits=True, router_aux_loss_coef=0.1), path)
    engine = _engine(path)
    assert engine.config.output_router_logits
    batches = [_batch(1), _batch(2, rows=1), _batch(3, pad=5)]
    # one micro-batch, two (grad accumulation), one with padding (segment 0: transformers' attention mask)
    for split in ([batches[0]], batches[:2], [batches[2]]):
        n_step = torch.stack([SFT.count(b) for b in split]).sum().float()
        hf.zero_grad(set_to_none=True)
        ref_loss = torch.zeros(())
        aux_ref = torch.zeros(())
        for b in split:
            u = SFT.count(b)
            mask = (b["segment_ids"] > 0).long() if "segment_ids" in b else None
            out = hf(b["input_ids"], attention_mask=mask, labels=b["labels"])  # mean CE + coef x aux
            loss = out.loss * u / n_step  # the micro-batch's share of the step
            loss.backward()
            ref_loss += loss.detach()
            aux_ref += out.aux_loss.detach() * u / n_step
        engine.optimizer.zero_grad(set_to_none=True)
        ours, _ = engine.forward_backward(split, n_step, SFT)
        torch.testing.assert_close(ours, ref_loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(engine.take_aux_loss(), aux_ref, rtol=1e-5, atol=1e-7)
        ref_grads = {name: p.grad for name, p in hf.named_parameters()}
        for name, p in engine.model.named_parameters():
            ref = ref_grads[base_param_name(name)]
            assert p.grad is not None and ref is not None, name
            torch.testing.assert_close(p.grad, ref.reshape(p.grad.shape), rtol=1e-5, atol=1e-6, msg=name)


def test_without_output_router_logits_no_aux(tmp_path):
    path = tmp_path / "plain"
    build_tiny_moe(tiny_moe_config("qwen3_moe"), path)  # transformers' default: output_router_logits false
    engine = _engine(path)
    engine.forward_backward([_batch(1)], SFT.count(_batch(1)).float(), SFT)
    assert engine.take_aux_loss() is None


def test_run_logs_aux_loss(moe_with_tokenizer, tmp_path):  # noqa: F811
    """``nxd-finetune run`` on an MoE model with ``output_router_logits``: each record has ``aux_loss``
    (the router auxiliary loss without its coefficient: near 1 for a balanced router)."""
    config = moe_with_tokenizer / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "output_router_logits": True}))
    summary = train(tmp_path / "run", moe_with_tokenizer, "lora=null", "logging.every_n_steps=1")
    records = [r for r in summary["history"] if "train_loss" in r]
    assert len(records) == 2 and all(0.5 < r["aux_loss"] < 3.0 for r in records)


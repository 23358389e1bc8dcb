"""The tiny training run the checkpoint tests save and resume: a 2-layer decoder with LoRA, AdamW in
two groups (as the engine's) and a warmup/decay schedule, trained on fixed ids."""

from __future__ import annotations

import torch

from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.loss import causal_lm_loss
from nxd_finetune.models import DecoderConfig, DecoderForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
LABELS = torch.where(torch.arange(12) < 3, -100, IDS)


def make_run(lora: bool = True, seed: int = 0):
    """The tiny model (same base weights for every seed; ``seed`` draws the LoRA factors), AdamW
    over its trainable parameters (two groups, as ``sft.build``) and a warmup/decay schedule."""
    torch.manual_seed(0)
    model = DecoderForCausalLM(DecoderConfig(**TINY))
    torch.manual_seed(seed)
    if lora:
        inject_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights="gaussian"))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9 ** s)
    return model, opt, sched


def train(model, opt, sched, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = causal_lm_loss(model(IDS), LABELS)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

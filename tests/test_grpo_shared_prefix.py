"""A GRPO micro-batch's rows that share a prompt run it once (``models/shared_prefix.py``): the
hidden states and gradients equal the full forward's (per family, LoRA in train mode), and a GRPO
run's training passes embed each distinct prompt once, its rows' completions apart."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.models import load_pretrained
from nxd_finetune.models.shared_prefix import can_share_prefix, shared_prefix_hidden
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft.trainer import run
from tests.model_helpers import TINY_FAMILIES
from tests.rl_helpers import grpo_recipe

FAMILIES = ["llama", "qwen3", "mistral-sliding", "phi3", "gemma2", "gemma3"]
PROMPTS = [[5, 9, 17, 3, 22, 41, 7], [11, 2], [64, 3, 90, 12]]


def _rows() -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """Three prompts x 3 completions of different lengths, laid out as GRPO's micro-batches (prompt
    then completion, right-padded with 0); the flat positions that predict a completion token."""
    rows, plen, lengths = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for k in range(3):
            completion = [(13 * i + 7 * k + 5 * j) % 120 + 1 for j in range(9 - 3 * k)]
            rows.append(prompt + completion)
            plen.append(len(prompt))
            lengths.append(len(prompt) + len(completion))
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    index = torch.tensor([r * width + j for r in range(len(rows)) for j in range(plen[r] - 1, lengths[r] - 1)])
    return ids, plen, lengths, index


@pytest.mark.parametrize("name", FAMILIES)
def test_shared_prompts_equal_the_full_forward_and_its_gradients(make_tiny_hf, name):
    family, overrides = TINY_FAMILIES.get(name, ("llama", {}))
    _, path = make_tiny_hf(family, **overrides)
    model = load_pretrained(path)
    torch.manual_seed(0)
    inject_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "lora_B" in key:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(key)))
    model.train()
    ids, plen, lengths, index = _rows()
    assert can_share_prefix(model, ids.shape[1])
    trainable = [p for p in model.parameters() if p.requires_grad]
    full = model.model(ids, None, None, index)
    shared = shared_prefix_hidden(model, ids, torch.tensor(plen), torch.tensor(lengths), index)
    assert shared.shape == full.shape
    assert (shared - full).abs().max().item() <= 1e-5 * max(1.0, full.abs().max().item()), name  # float rounding
    expected = torch.autograd.grad(model.head(full).logsumexp(-1).sum(), trainable)
    got = torch.autograd.grad(model.head(shared).logsumexp(-1).sum(), trainable)
    # the rows' gradients add up in their shared prompt before (not after) flowing back through it:
    # another order of fp32 sums (Gemma's scaled embeddings and sandwich norms amplify it most)
    for e, g in zip(expected, got, strict=True):
        assert (e - g).abs().max().item() <= 5e-5 * max(1.0, e.abs().max().item()), name


def test_active_dropout_or_recomputed_layers_run_the_full_forward(make_tiny_hf):
    """A shared prompt would draw one dropout mask for its rows; layers recomputed in backward
    (activation checkpointing patches their forward) would not be: both keep the full forward."""
    from nxd_finetune.parallel.parallelize import apply_activation_checkpointing

    _, path = make_tiny_hf("llama")
    model = load_pretrained(path)
    inject_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    assert not can_share_prefix(model.train(), 16)
    assert can_share_prefix(model.eval(), 16)
    plain = load_pretrained(path).train()
    assert can_share_prefix(plain, 16)
    apply_activation_checkpointing(plain, "full")
    assert not can_share_prefix(plain, 16)


def test_a_grpo_run_embeds_each_prompt_once_per_training_pass(make_tiny_hf, tmp_path):
    """Two prompts x 4 completions per step: every pass over the 8 rows (sampling, the old-policy
    and reference log-probs, the loss) embeds the 2 prompts once and the rows' completions (at
    most max_completion_length = 4 tokens each), never the 8 rows' whole prompt + completion."""
    _, model_dir = make_tiny_hf("llama")
    seen: list[tuple[int, ...]] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], result: torch.Tensor) -> None:
        if isinstance(module, nn.Embedding):
            seen.append(tuple(args[0].shape))

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        run(recipe_from_dict(grpo_recipe(tmp_path, model_dir, tmp_path / "out", 2)))
    finally:
        handle.remove()
    rows = [shape for shape in seen if shape[0] == 8]
    assert rows and all(width <= 4 for _, width in rows), seen
    assert seen.count(seen[0]) >= 4 and seen[0][0] == 2  # the 2 prompts: prefill, then each pass

"""The RL sampler on our model's KV cache (``models/decode.py``, ``rl/sampler.py``) against
transformers: cached logits equal the full forward's at every position, greedy completions equal
``generate(do_sample=False)`` on left-padded batches, the warpers equal transformers' own, and a
seeded run repeats (from a saved generator state too)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from nxd_finetune.errors import NxdError
from nxd_finetune.models import load_pretrained
from nxd_finetune.models.decode import decode, new_cache
from nxd_finetune.rl.sampler import SamplingSettings, left_pad, sample, warp
from tests.model_helpers import NO_SDPA, TINY_FAMILIES

FAMILIES = ["llama", "qwen3", "mistral-sliding", "phi3", "gemma2", "gemma3"]
PROMPTS = [[5, 9, 17, 3, 22, 41, 7], [11, 2], [64, 3, 90, 12]]


def _model(make_tiny_hf, name: str):
    family, overrides = TINY_FAMILIES.get(name, ("llama", {}))
    _, path = make_tiny_hf(family, **overrides)
    return path, load_pretrained(path).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_cached_logits_equal_the_full_forward(make_tiny_hf, name):
    """Prefill the left-padded prompts, then one token at a time: every real position's logits
    equal the uncached forward of that row alone (1e-5). Rows reach past the sliding windows."""
    _, model = _model(make_tiny_hf, name)
    _check_cached_equals_full(model, name, steps=12)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_completions_equal_transformers_generate(make_tiny_hf, name):
    path, model = _model(make_tiny_hf, name)
    attn = "eager" if name.startswith(NO_SDPA) else "sdpa"
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=torch.float32).eval()
    ids, mask = left_pad(PROMPTS, 0)

    def hf_generate(eos: list[int]) -> list[list[int]]:
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0,
                          eos_token_id=eos or None)[:, ids.shape[1]:]
        rows = []
        for row in out.tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    free = hf_generate([])
    eos = [free[0][4], free[1][6]]  # rows stop early, at different steps
    expected = hf_generate(eos)
    got = sample(model, PROMPTS, SamplingSettings(max_completion_length=10, temperature=0), eos, 0,
                 torch.Generator().manual_seed(0))
    assert got.completions() == expected
    assert got.truncated.tolist() == [not any(t in eos for t in row) for row in expected]
    assert got.completions() != free  # the stop ids did stop rows


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8),
                                      dict(temperature=1.3, top_k=20, top_p=0.9)])
def test_warpers_equal_transformers(settings):
    logits = torch.randn(6, 128, generator=torch.Generator().manual_seed(3)) * 3
    s = SamplingSettings(max_completion_length=1, **settings)
    expected = logits.clone()
    if s.temperature != 1.0:
        expected = TemperatureLogitsWarper(s.temperature)(None, expected)
    if s.top_k:
        expected = TopKLogitsWarper(s.top_k)(None, expected)
    if s.top_p < 1.0:
        expected = TopPLogitsWarper(s.top_p)(None, expected)
    assert torch.equal(warp(logits, s), expected)


def test_seeded_sampling_repeats_and_resumes_from_a_saved_state(make_tiny_hf):
    _, model = _model(make_tiny_hf, "qwen3")
    settings = SamplingSettings(max_completion_length=8, temperature=1.0, top_p=0.95, top_k=50)

    def run(generator: torch.Generator):
        return sample(model, PROMPTS, settings, [1], 0, generator, num_generations=4)

    first = torch.Generator().manual_seed(7)
    a = run(first)
    state = first.get_state()
    b = run(first)
    again = torch.Generator().manual_seed(7)
    assert torch.equal(run(again).completion_ids, a.completion_ids)
    restored = torch.Generator()
    restored.set_state(state)
    assert torch.equal(run(restored).completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, b.completion_ids)
    # a group's 4 rows share a prompt and differ in what they drew
    assert a.prompt_ids.shape[0] == 12 and torch.equal(a.prompt_ids[0], a.prompt_ids[3])
    assert len({tuple(r) for r in a.completions()[:4]}) > 1



def test_per_row_generators_draw_the_same_however_the_rows_are_split(make_tiny_hf):
    """One generator per row (the GRPO source's, seeded by the row's place in the generation
    batch): a row's completion is the same sampled with every row or with only some (its rank's
    share under dp), and its first token is the one-row draw of that seed."""
    _, model = _model(make_tiny_hf, "llama")
    settings = SamplingSettings(max_completion_length=6, temperature=1.0, top_p=0.9)
    rows = [p for p in PROMPTS for _ in range(2)]

    def gens(seeds: range) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + s) for s in seeds]

    whole = sample(model, rows, settings, [1], 0, gens(range(6))).completions()
    halves = (sample(model, rows[:3], settings, [1], 0, gens(range(3))).completions()
              + sample(model, rows[3:], settings, [1], 0, gens(range(3, 6))).completions())
    assert whole == halves and len({tuple(c) for c in whole}) > 3
    alone = sample(model, rows[4:5], settings, [1], 0, torch.Generator().manual_seed(104)).completions()
    assert alone[0][0] == whole[4][0]

def test_longrope_past_its_original_length_is_refused(make_tiny_hf):
    _, model = _model(make_tiny_hf, "phi3-longrope")
    with pytest.raises(NxdError, match="original_max_position_embeddings \\(16\\)") as err:
        sample(model, PROMPTS, SamplingSettings(max_completion_length=10), [1], 0, torch.Generator())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_cached_logits_of_mixture_of_experts_models(tmp_path, family):
    from tests.moe_helpers import build_tiny_moe, tiny_moe_config

    build_tiny_moe(tiny_moe_config(family), tmp_path / family)
    model = load_pretrained(tmp_path / family).eval()
    _check_cached_equals_full(model, family)


def test_cached_logits_with_lora(make_tiny_hf):
    """LoRA's layers (B non-zero, dropout on but off in eval) are the layer parts the cache runs."""
    from nxd_finetune.lora import LoraConfig, inject_lora

    _, model = _model(make_tiny_hf, "qwen3")
    inject_lora(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    _check_cached_equals_full(model.eval(), "lora")


def _check_cached_equals_full(model, what: str, steps: int = 6) -> None:
    rows = [p + [(7 * i + 3 * j) % 128 for j in range(steps)] for i, p in enumerate(PROMPTS)]
    ids, mask = left_pad(PROMPTS, 0)
    cache = new_cache(len(rows), ids.shape[1] + steps, torch.device("cpu"))
    with torch.no_grad():
        logits = [decode(model, ids, mask, cache)]
        for j in range(steps):
            token = torch.tensor([[r[len(p) + j]] for r, p in zip(rows, PROMPTS, strict=True)])
            logits.append(decode(model, token, torch.ones_like(token), cache))
        cached = torch.cat(logits, dim=1)
        for i, (row, prompt) in enumerate(zip(rows, PROMPTS, strict=True)):
            full = model(torch.tensor([row]))[0]
            assert (cached[i, ids.shape[1] - len(prompt):] - full).abs().max().item() <= 1e-5, what


def test_sampled_completions_equal_transformers_with_the_same_seed(make_tiny_hf):
    """transformers draws with ``torch.multinomial`` on the global generator, one draw per step over
    all rows, as ours does on the given one: seeded alike, the same tokens."""
    path, model = _model(make_tiny_hf, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = left_pad(PROMPTS, 0)
    settings = SamplingSettings(max_completion_length=12, temperature=0.8, top_p=0.9, top_k=40)
    torch.manual_seed(11)
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=12, pad_token_id=0,
                      eos_token_id=None, temperature=0.8, top_p=0.9, top_k=40)[:, ids.shape[1]:]
    got = sample(model, PROMPTS, settings, [], 0, torch.Generator().manual_seed(11))
    assert torch.equal(got.completion_ids, out)


def test_a_pipeline_stage_is_refused(make_tiny_hf):
    _, model = _model(make_tiny_hf, "llama")
    model.lm_head = None
    with pytest.raises(NxdError, match="needs the whole model; this one is a pipeline stage"):
        sample(model, PROMPTS, SamplingSettings(max_completion_length=2), [1], 0, torch.Generator())


def test_a_group_sharing_a_prompt_prefills_it_once(make_tiny_hf):
    """num_generations rows of one prompt: the prompt is decoded once (the embedding sees the 3
    distinct prompts, not 6 rows) and its cache copied to the group, drawing what transformers
    draws on the 6 rows with the same seed."""
    path, model = _model(make_tiny_hf, "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = [p for p in PROMPTS for _ in range(2)]
    ids, mask = left_pad(rows, 0)
    torch.manual_seed(5)
    out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=8, pad_token_id=0,
                      eos_token_id=None, temperature=1.0, top_p=1.0, top_k=0)[:, ids.shape[1]:]
    seen: list[tuple[int, ...]] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, result: seen.append(tuple(args[0].shape)))
    try:
        got = sample(model, PROMPTS, SamplingSettings(max_completion_length=8), [], 0,
                     torch.Generator().manual_seed(5), num_generations=2)
    finally:
        hook.remove()
    assert torch.equal(got.completion_ids, out)
    assert seen[0] == (3, ids.shape[1]) and seen[1:] == [(6, 1)] * 7

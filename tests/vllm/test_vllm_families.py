"""Adapters of the families beyond Llama served by vLLM's CPU build like ``peft``: a Qwen3
(``Qwen3ForCausalLM``: q/k norms) and a Gemma 3 text model (``Gemma3ForCausalLM``: q/k norms, sliding
and full layers with their own rope, embeddings scaled by sqrt(hidden)), each a tiny random
checkpoint. A LoRA adapter (all linear layers) is trained a few steps by ``nxd-finetune run`` and
served by one ``vllm serve BASE --enable-lora --lora-modules NAME=DIR`` per family: greedy completions
of the base and of the adapter equal transformers + peft ``generate`` token for token, and the
adapter changes the answers.

- Qwen3: ``builtin:tiny-qwen3`` (the Qwen3 quickstart's model, Qwen3's tokens and chat template),
  trained by ``recipes/quickstart-qwen3.yaml``;
- Gemma 3: built here with transformers (fixed seed, norms perturbed), head_dim 32 (vLLM's CPU
  attention takes 32, 64, 80, ...) and a sliding window shorter than the prompts, with the
  quickstart's tokenizer; trained by ``recipes/quickstart.yaml``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

pytest.importorskip("vllm")
pytest.importorskip("openai")

from nxd_finetune.quickstart import TINY_QWEN3, ensure_tiny_model  # noqa: E402
from tests.conftest import build_tiny_hf, tiny_hf_config  # noqa: E402
from tests.vllm.serving import (  # noqa: E402
    ROOT,
    assert_same,
    chat_prompts,
    complete,
    peft_greedy,
    train,
    vllm_server,
)

TRAIN = ["training.max_steps=10", "training.warmup_steps=2", "eval.before=false", "eval.every_n_steps=null",
         "eval.max_batches=1", "checkpoint.every_n_steps=null", "logging.progress=false"]
# sliding, full, sliding layers; the full layer's rope linearly scaled, the sliding ones on a local base
GEMMA3 = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              intermediate_size=256, query_pre_attn_scalar=24, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _gemma3_dir(path: Path) -> Path:
    """The tiny Gemma 3 with the quickstart tokenizer (its special token ids: pad 0, bos 1, eos 2)."""
    tok_dir = ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    config = tiny_hf_config("gemma3", **GEMMA3, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    build_tiny_hf(config, path, seed=0)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


def _base_and_recipe(family: str, work: Path) -> tuple[Path, Path]:
    if family == "qwen3":
        return ensure_tiny_model(name=TINY_QWEN3), ROOT / "recipes" / "quickstart-qwen3.yaml"
    return _gemma3_dir(work / "gemma3"), ROOT / "recipes" / "quickstart.yaml"


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family(request, tmp_path_factory, quickstart_cache):
    """One family's base, trained adapter, prompts and peft's answers, and its vLLM server:
    ``(name, base dir, prompts, expected, client)``."""
    name = request.param
    work = tmp_path_factory.mktemp(f"vllm-{name}")
    base, recipe = _base_and_recipe(name, work)
    adapter = train(work, recipe, work / "run", *TRAIN, f"model.path={base}")
    prompts = chat_prompts(base)
    expected = peft_greedy(base, {name: adapter}, prompts)
    with vllm_server(base, work, work / "vllm-server.log", ["--max-loras", "1", "--lora-modules",
                                                             f"{name}-lora={adapter}"]) as client:
        yield name, base, prompts, expected, client


def test_family_adapter_serves_like_peft(family):
    name, base, prompts, expected, client = family
    assert_same(complete(client, str(base), prompts), expected["base"], f"{name} base")
    assert expected[name].ids != expected["base"].ids, name  # the adapter changes the answers
    assert_same(complete(client, f"{name}-lora", prompts), expected[name], f"{name} adapter")

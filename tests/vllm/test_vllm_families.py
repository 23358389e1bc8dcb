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
- Gemma 3 multimodal (``Gemma3ForConditionalGeneration``, text prompts only): the same language
  model under a tiny SigLIP tower (28 px images of 14 px patches, 2x2 patches pooled to
  ``mm_tokens_per_image`` 4, as vLLM's projector requires) and transformers' Gemma 3 processor.
  vLLM's Gemma 3 prompt processing looks up ``"\\n"`` .. ``"\\n\\n\\n\\n"`` as single tokens, so the
  tokenizer adds them with the image tokens; the weights are stored under the Hub checkpoints'
  names (``vision_tower.vision_model.*``), the ones vLLM's Gemma 3 loader knows (transformers reads
  both). The adapter (``model.language_model.*`` names, a regex ``target_modules``) is trained by
  ``recipes/quickstart.yaml`` and compared with ``peft`` on transformers' multimodal model. vLLM's
  Gemma 3 module imports transformers' image processor, which needs torchvision: skipped where
  torchvision does not import (``make setup-vllm`` removes the index's, built for CUDA torch).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Gemma3Config

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


VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=14)
MM_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def _gemma3_mm_dir(path: Path) -> Path:
    """The tiny Gemma 3 language model under a tiny vision tower, with a Gemma 3 processor."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor  # the image processor imports torchvision

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model(), extra_special_tokens=MM_TOKENS)
    tok.add_tokens(["\n" * n for n in range(1, 5)])
    ids = {key: tok.convert_tokens_to_ids(token) for key, token in MM_TOKENS.items()}
    text = dict(**GEMMA3, vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id)
    config = Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4,
                          image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                          eoi_token_index=ids["eoi_token"])
    build_tiny_hf(config, path, seed=0)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    tensors = load_file(path / "model.safetensors")
    save_file({k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()},
              path / "model.safetensors", metadata={"format": "pt"})
    image = Gemma3ImageProcessor(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    Gemma3Processor(image_processor=image, tokenizer=tok, chat_template=tok.chat_template,
                    image_seq_length=config.mm_tokens_per_image).save_pretrained(path)
    return path


def _base_and_recipe(family: str, work: Path) -> tuple[Path, Path]:
    if family == "qwen3":
        return ensure_tiny_model(name=TINY_QWEN3), ROOT / "recipes" / "quickstart-qwen3.yaml"
    if family == "gemma3-mm":
        if importlib.util.find_spec("torchvision") is None:
            pytest.skip("vLLM's Gemma3ForConditionalGeneration imports transformers' Gemma 3 image processor, "
                        "which needs torchvision")
        return _gemma3_mm_dir(work / "gemma3-mm"), ROOT / "recipes" / "quickstart.yaml"
    return _gemma3_dir(work / "gemma3"), ROOT / "recipes" / "quickstart.yaml"


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "gemma3-mm"])
def family(request, tmp_path_factory, quickstart_cache):
    """One family's base, trained adapter, prompts and peft's answers, and its vLLM server:
    ``(name, base dir, prompts, expected, client)``."""
    name = request.param
    work = tmp_path_factory.mktemp(f"vllm-{name}")
    base, recipe = _base_and_recipe(name, work)
    adapter = train(work, recipe, work / "run", *TRAIN, f"model.path={base}")
    if name == "gemma3-mm":  # transformers' module names, the language-model linears named by a regex
        assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"].startswith(
            r"model\.language_model\.layers\.")
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

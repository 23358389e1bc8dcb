"""Tiny mixture-of-experts configs (Qwen3-MoE, Mixtral) for the model tests: built locally, never
from the Hub; a tiny Qwen3-MoE with the quickstart tokenizer and a short quickstart run on it."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from layout_helpers import run_layouts
from transformers import MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import Recipe, load_recipe

# conftest's TINY sizes
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 256}
QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
MOE_FAMILIES = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
STEPS = 4
# the layout tests' recipe (:func:`moe_recipe`): STEPS optimizer steps, fp32-exact settings
BASE = ["data.max_seq_len=64", f"training.max_steps={STEPS}", "training.warmup_steps=1", "training.eps=1e-5",
        "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null",
        "checkpoint.every_n_steps=null"]
MODES = {"lora": ["lora.dropout=0", "lora.target_modules=[q_proj,o_proj]",
                  "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"],
         "sft": ["lora=null", "training.lr=5e-4"]}


def tiny_moe_config(family: str = "qwen3_moe", **overrides: object) -> PretrainedConfig:
    """``qwen3_moe``: 6 experts of width 32, top 2, renormalised, layer 1 dense (``mlp_only_layers``);
    ``mixtral``: 4 experts of width 96, top 2."""
    if family == "qwen3_moe":
        base = {**TINY, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "norm_topk_prob": True, "mlp_only_layers": [1]}
        return Qwen3MoeConfig(**{**base, **overrides})
    return MixtralConfig(**{**TINY, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})


def build_tiny_moe(config: PretrainedConfig, path: Path, seed: int = 0) -> torch.nn.Module:
    """Random-init ``config`` (norms perturbed, router weights spread so routing is decisive) with
    ``seed``, saved to ``path`` as transformers writes it; returns the model (eager attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture
def moe_with_tokenizer(quickstart_cache: object, tmp_path: Path) -> Path:
    """A tiny Qwen3-MoE with the quickstart's tokenizer (its vocabulary size)."""
    from transformers import AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    tok_dir = ensure_tiny_model()
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    path = tmp_path / "moe"
    build_tiny_moe(tiny_moe_config("qwen3_moe", vocab_size=vocab), path)
    for f in Path(tok_dir).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


def build_mixtral_with_aux(path: Path, **overrides: object) -> Path:
    """A tiny Mixtral (4 experts, every layer MoE; config ``overrides``) with the quickstart's
    tokenizer at ``path``, trained with its router auxiliary loss (``output_router_logits``, coef 0.1)."""
    from transformers import AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    tok_dir = ensure_tiny_model()
    config = tiny_moe_config("mixtral", vocab_size=len(AutoTokenizer.from_pretrained(tok_dir)),
                             output_router_logits=True, router_aux_loss_coef=0.1, **overrides)
    build_tiny_moe(config, path)
    for f in Path(tok_dir).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture
def mixtral_with_aux(quickstart_cache: object, tmp_path: Path) -> Path:
    """:func:`build_mixtral_with_aux` (two layers) in ``tmp_path``."""
    return build_mixtral_with_aux(tmp_path / "mixtral")


def moe_recipe(model: Path, out: Path, nproc: int, *overrides: str) -> Recipe:
    """The quickstart recipe on ``model`` with :data:`BASE`, ``nproc`` processes and ``overrides``."""
    return load_recipe(QUICKSTART, [*BASE, f"model.path={model}", f"parallel.nproc={nproc}", f"output.dir={out}",
                                    *overrides])


def launch_layouts(model: Path, out: Path, world: int, layouts: dict[str, list[str]],
                   modes: dict[str, list[str]]) -> list[tuple[str, dict | None]]:
    """Every mode x layout of :func:`moe_recipe` (``world`` processes, into ``out/<mode>/<layout>``,
    the layout's overrides then the mode's) run in one gloo world of ``world`` processes: each run's
    ``<mode>/<layout>`` name and rank 0's summary."""
    names, dicts = [], []
    for mode, extra in modes.items():
        for layout, overrides in layouts.items():
            names.append(f"{mode}/{layout}")
            dicts.append(moe_recipe(model, out / mode / layout, world, *overrides, *extra).to_dict())
    results = launch(run_layouts, world, dicts, start_method="fork")
    return list(zip(names, results[0], strict=True))


def train(tmp_path: Path, model: Path, *overrides: str) -> dict[str, object]:
    """Two quickstart steps on ``model`` into ``tmp_path`` with recipe ``overrides``; the run's summary."""
    from nxd_finetune.sft import trainer

    recipe = load_recipe(QUICKSTART, [f"model.path={model}", "data.max_seq_len=64", "training.max_steps=2",
                                      "training.micro_batch_size=2", "training.warmup_steps=0",
                                      "logging.progress=false", "eval.max_batches=1", f"output.dir={tmp_path}",
                                      *overrides])
    return trainer.run(recipe)


def doc_commands() -> dict[str, list[str]]:
    """The ``nxd-finetune`` lines of docs/models.md's bash blocks (comments dropped), by line."""
    text = (QUICKSTART.parents[1] / "docs" / "models.md").read_text()
    lines = [ln.strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in block.splitlines()]
    argvs = (shlex.split(line, comments=True) for line in lines)
    return {" ".join(argv): argv for argv in argvs if argv[:1] == ["nxd-finetune"]}

"""DPO on a mixture-of-experts model under pipeline parallel, end to end in a real gloo world: a tiny
Mixtral (4 experts, every layer MoE) trained with its router auxiliary loss (coef 0.1), LoRA on
attention and both fused expert tensors with the router in ``modules_to_save``, and full
fine-tuning. pp2 (1F1B) and pp2 with the output layer chunked reproduce the single-process run:
the loss and reward curve and the logged ``aux_loss`` (1e-5), the final adapter / weights (2e-5).

The auxiliary loss counts each pair's prompt and both completions up to its last completion label,
as one process counts them; the pipeline pads every pair to one shape, so a count that included the
padding would show here as a different ``aux_loss``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layout_helpers import assert_same_files, run_layouts
from moe_helpers import build_tiny_moe, tiny_moe_config

from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft import trainer
from tests.preference_helpers import STEPS, assert_same_curve, pairs, word_tokenizer

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("workers_tmpdir")

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MODES: dict[str, dict[str, object]] = {
    "lora": {"lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "o_proj"],
                      "target_parameters": EXPERTS, "modules_to_save": ["gate"]}},
    "full": {"lora": None},
}
LAYOUTS: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "pp2-1f1b": ({"pp": 2}, {}),
    "pp2-chunked": ({"pp": 2}, {"loss_chunk_tokens": 8}),
}


def _setup(root: Path) -> dict[str, Path]:
    model, tok, train = root / "mixtral", root / "tok", root / "pairs.jsonl"
    build_tiny_moe(tiny_moe_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.1), model)
    word_tokenizer().save_pretrained(tok)
    train.write_text("".join(json.dumps(d) + "\n" for d in pairs(2 * STEPS, seed=11)))
    return {"model": model, "tok": tok, "train": train}


def _recipe(setup: dict[str, Path], out: Path, nproc: int, mode: str,
            parallel: dict[str, object], training: dict[str, object]) -> dict[str, object]:
    return {
        "model": {"path": str(setup["model"]), "tokenizer": str(setup["tok"])},
        "data": {"train": str(setup["train"]), "format": "preference", "packing": False, "shuffle": False,
                 "max_seq_len": 64, "cache_dir": str(out.parent / "cache")},
        "objective": "dpo", "preference": {"beta": 0.1},
        "training": {"scheduler": "constant", "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.0,
                     "device": "cpu", "max_steps": STEPS, "lr": 5e-3, "eps": 1e-6, "micro_batch_size": 1,
                     "grad_accum": 2, **training},
        "parallel": {"nproc": nproc, **parallel},
        "output": {"dir": str(out)}, "logging": {"progress": False, "every_n_steps": 1},
        "eval": {"before": False, "every_n_steps": None}, "checkpoint": {"every_n_steps": None},
        **MODES[mode],
    }


@pytest.mark.slow  # a world of 2 gloo processes
def test_dpo_on_moe_with_router_aux_loss_under_pp_matches_one_process(tmp_path):
    setup = _setup(tmp_path)
    refs = {mode: trainer.run(recipe_from_dict(_recipe(setup, tmp_path / mode / "single", 1, mode, {}, {})))
            for mode in MODES}
    names = [(mode, name) for mode in MODES for name in LAYOUTS]
    dicts = [_recipe(setup, tmp_path / mode / name, 2, mode, *LAYOUTS[name]) for mode, name in names]
    results = launch(run_layouts, 2, dicts, start_method="fork")[0]
    for (mode, name), got in zip(names, results, strict=True):
        ref = refs[mode]
        assert ref is not None and got is not None and got["parallel"]["pp"] == 2, (mode, name)
        assert all("aux_loss" in h for h in ref["history"] if "train_loss" in h), mode
        aux = [torch.tensor([h["aux_loss"] for h in s["history"] if "train_loss" in h]) for s in (got, ref)]
        assert len(set(aux[1].tolist())) > 1, (mode, aux)
        assert torch.allclose(aux[0], aux[1], rtol=1e-5, atol=0), (mode, name, aux)
        assert_same_curve(f"{mode}/{name}", got, ref)
        assert_same_files(f"{mode}/{name}", got, ref)

"""The router auxiliary loss (``output_router_logits``) under pipeline parallel, through the trainer
in real gloo worlds: a tiny Mixtral (4 experts, every layer MoE, so both stages route) with
``router_aux_loss_coef`` 0.1, 4 optimizer steps of single-row micro-batches, fp32, LoRA on
attention and the experts with the router in ``modules_to_save`` (the auxiliary loss reaches it)
and full fine-tuning.

Each stage adds its layers' assignment counts, probability sums (with their gradient) and token
count to a running sum sent with the hidden states; the last stage's auxiliary loss on the totals
sends each stage its gradient back. Every layout equals the single-process run (loss and logged
``aux_loss`` 1e-5 relative, gradient norms 1e-4, final adapter / weights 2e-5): pp2 (packed rows,
and unpacked rows of unequal length, which the pipeline pads to one shape), pp2 x ep2 with every
layer recomputed in backward, pp2 x tp2, and a four-layer model interleaved (two stages per rank).
"""

from __future__ import annotations

import pytest
import torch
from layout_helpers import assert_same_curves, assert_same_files
from moe_helpers import MODES as EP_MODES
from moe_helpers import (
    build_mixtral_with_aux,
    launch_layouts,
    mixtral_with_aux,  # noqa: F401  (a fixture)
)
from moe_helpers import moe_recipe as _recipe

from nxd_finetune.sft import trainer

STEPS = 4
MODES = {"lora": [*EP_MODES["lora"], "lora.modules_to_save=[gate]"], "sft": EP_MODES["sft"]}
UNPACKED = ["data.packing=false"]
SINGLE = ["training.micro_batch_size=1"]
# world size -> layout -> overrides; each sees 4 single-row micro-batches per optimizer step
LAYOUTS: dict[int, dict[str, list[str]]] = {
    2: {"pp2": ["parallel.pp=2", *SINGLE, "training.grad_accum=4"],
        "pp2-unpacked": ["parallel.pp=2", *SINGLE, "training.grad_accum=4", *UNPACKED]},
    4: {"pp2-ep2-recompute": ["parallel.pp=2", "parallel.ep=2", *SINGLE, "training.grad_accum=2",
                              "parallel.activation_checkpointing=full"],
        "pp2-tp2": ["parallel.pp=2", "parallel.tp=2", *SINGLE, "training.grad_accum=4"]},
}

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


@pytest.mark.slow  # worlds of 2 and 4 gloo processes
def test_pipeline_with_router_aux_loss_reproduces_one_process(mixtral_with_aux, tmp_path):  # noqa: F811
    model = mixtral_with_aux
    refs = {(mode, packed): trainer.run(_recipe(model, tmp_path / "ref" / f"{mode}-{packed}", 1, *SINGLE,
                                                "training.grad_accum=4", *extra, *([] if packed else UNPACKED)))
            for mode, extra in MODES.items() for packed in (True, False)}
    for world, layouts in LAYOUTS.items():
        for name, got in launch_layouts(model, tmp_path, world, layouts, MODES):
            ref = refs[(name.split("/")[0], "unpacked" not in name)]
            assert got is not None and got["parallel"]["pp"] == 2, name
            assert all("aux_loss" in h for h in got["history"]), name
            aux = [torch.tensor([h["aux_loss"] for h in s["history"]]) for s in (got, ref)]
            assert torch.allclose(aux[0], aux[1], rtol=1e-5, atol=0), (name, aux)
            assert_same_curves(name, got, ref, STEPS)
            assert_same_files(name, got, ref)


@pytest.mark.slow  # a world of 2 gloo processes
def test_interleaved_pipeline_with_router_aux_loss_reproduces_one_process(quickstart_cache, tmp_path):
    """Four layers in four stages, two on each rank (``interleaved_1f1b``): each rank adds the sums of
    both its chunks, the running sum crossing between ranks three times."""
    model = build_mixtral_with_aux(tmp_path / "mixtral4", num_hidden_layers=4)
    extra = [*MODES["lora"], *SINGLE, "training.grad_accum=4", *UNPACKED]
    ref = trainer.run(_recipe(model, tmp_path / "ref", 1, *extra))
    layout = {"pp2-vs2": ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.pp_schedule=interleaved_1f1b"]}
    [(name, got)] = launch_layouts(model, tmp_path, 2, layout, {"lora": extra})
    assert got is not None and got["parallel"]["pp"] == 2, name
    aux = [torch.tensor([h["aux_loss"] for h in s["history"]]) for s in (got, ref)]
    assert torch.allclose(aux[0], aux[1], rtol=1e-5, atol=0), (name, aux)
    assert_same_curves(name, got, ref, STEPS)
    assert_same_files(name, got, ref)


def test_router_masks_count_what_one_process_counts():
    """Unpacked rows padded to ``max_seq_len`` (the loader's fixed shape under pp) count up to the
    micro-batch's longest row, as one process's batch is that wide; packed rows their segments; the
    pipeline's own padding to one shape nothing."""
    from nxd_finetune.data.packing import collate
    from nxd_finetune.parallel.pipeline_io import router_masks

    class Samples:
        def tensors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.arange(3 + 2 * i), torch.arange(3 + 2 * i)

    unpacked = {k: v for k, v in collate(Samples(), [[0], [2]], 0, seq_len=10).items() if k != "segment_ids"}
    packed = collate(Samples(), [[0, 1]], 0, seq_len=10)  # 3 + 5 tokens, 2 of padding
    got = router_masks([unpacked, packed], 2, 10)
    assert got[:2].tolist() == [[True] * 7 + [False] * 3] * 2  # the longer row's 7 tokens, both rows
    assert got[2].tolist() == [True] * 8 + [False] * 2 and not got[3].any()  # a padding row of the pipeline's


def test_router_masks_count_preference_pairs_as_one_process():
    """Preference pairs padded to ``max_seq_len`` (pp's fixed shape) count every token up to the
    micro-batch's longest sequence, the width one process's pairs batch has (padding pairs included)."""
    from nxd_finetune.data.pairs import PreferencePairs, collate_pairs
    from nxd_finetune.parallel.pipeline_io import router_masks

    class Sequences:  # pair i: chosen of 4 + i tokens, rejected of 3 tokens; the last two are labels
        def __len__(self) -> int:
            return 4

        def tensors(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
            n = 4 + s // 2 if s % 2 == 0 else 3
            return torch.arange(1, n + 1), torch.cat([torch.full((n - 2,), -100), torch.arange(2)])

    pairs = PreferencePairs(Sequences())  # type: ignore[arg-type]
    one = collate_pairs(pairs, [0, 1, -1], 0)  # one process: as wide as the longest sequence (5)
    fixed = collate_pairs(pairs, [0, 1, -1], 0, seq_len=12)
    assert one["input_ids"].shape == (6, 5)
    got = router_masks([fixed], 6, 12)
    assert got.tolist() == [[True] * 5 + [False] * 7] * 6

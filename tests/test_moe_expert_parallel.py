"""Expert parallel (``parallel.ep``) through the trainer, in real gloo worlds (as ``nxd-finetune
run --nproc N``): a tiny Qwen3-MoE (6 experts, top 2, a dense second layer) with the quickstart's
tokenizer, 4 optimizer steps of 4 packed 64-token rows, fp32, LoRA on the experts (peft's
``target_parameters``, beside attention LoRA) and full fine-tuning.

Every layout equals the single-process run (loss curve 1e-5 relative, gradient norms 1e-4, final
adapter / full weights 2e-5 as the dense layouts' tests): ep2 (world 2); ep2 x tp2 (world 4: the
dense parts under tp, the router and the experts whole on each tp rank); dp4 with ep2 and ZeRO-1
(world 4: two ranks hold each expert; every layer recomputed in backward, its all-to-alls again);
pp2 with ep2 (world 4: the dense second layer alone on the last stage); a tiny Mixtral at ep2 with
the router auxiliary loss. ep2's step-2 checkpoints (each rank's experts gathered into the full
fused tensors) resume in one process and finish as the single-process run does. The experts'
gradients reach their ranks through the all-to-all's backward, so a wrong dispatch, combine or
reduction shows in the first step's norm.
"""

from __future__ import annotations

import pytest
import torch
from gloo_world import run_world
from layout_helpers import assert_same_curves, assert_same_files, assert_same_finish, run_layouts
from moe_helpers import (  # noqa: F401  (fixtures)
    MODES,
    STEPS,
    build_tiny_moe,
    launch_layouts,
    mixtral_with_aux,
    moe_recipe,
    moe_with_tokenizer,
    tiny_moe_config,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.models import DecoderConfig, build_model, materialize
from nxd_finetune.parallel import Layout, ParallelState
from nxd_finetune.parallel.experts import apply_expert_parallel, regroup_by_expert
from nxd_finetune.parallel.launch import launch
from nxd_finetune.parallel.plan import make_slice_reader
from nxd_finetune.sft import trainer

REFERENCE = ["training.micro_batch_size=2", "training.grad_accum=2"]
LAYOUTS = {  # world size -> layouts; every one sees 4 rows per optimizer step (micro x accum x dp)
    2: {"ep2": ["parallel.ep=2", "training.micro_batch_size=2", "training.grad_accum=1",
                "checkpoint.every_n_steps=2", "checkpoint.keep_last=2"]},
    4: {"ep2-tp2": ["parallel.tp=2", "parallel.ep=2", "training.micro_batch_size=2", "training.grad_accum=1"],
        "dp4-ep2-zero1": ["parallel.ep=2", "parallel.zero1=true", "training.micro_batch_size=1",
                          "training.grad_accum=1", "parallel.activation_checkpointing=full"],
        "pp2-ep2": ["parallel.pp=2", "parallel.ep=2", "training.micro_batch_size=1", "training.grad_accum=2"]},
}

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


@pytest.mark.slow  # worlds of 2 and 4 gloo processes
def test_expert_parallel_layouts_reproduce_one_process(quickstart_cache, moe_with_tokenizer, tmp_path):  # noqa: F811
    model = moe_with_tokenizer
    refs = {mode: trainer.run(moe_recipe(model, tmp_path / "ref" / mode, 1, *REFERENCE, *extra))
            for mode, extra in MODES.items()}
    for world, layouts in LAYOUTS.items():
        for name, got in launch_layouts(model, tmp_path, world, layouts, MODES):
            assert got is not None and got["parallel"]["nproc"] == world and got["parallel"]["ep"] == 2, name
            assert_same_curves(name, got, refs[name.split("/")[0]], STEPS)
            assert_same_files(name, got, refs[name.split("/")[0]])
    # ep2's checkpoints hold every rank's experts; resumed in one process they finish as one process does
    for mode, extra in MODES.items():
        step2 = tmp_path / mode / "ep2" / "checkpoints" / "step-00000002"
        if mode == "sft":
            shapes = {}
            for f in sorted(step2.glob("state-*.safetensors")):
                with safe_open(f, "pt") as st:
                    shapes.update((k, st.get_slice(k).get_shape()) for k in st.keys()
                                  if k.startswith("param/") and "experts.gate_up_proj" in k)
            assert shapes and all(s[0] == 6 for s in shapes.values()), shapes  # both ranks' 3 experts, gathered
        resumed = trainer.run(moe_recipe(model, tmp_path / "resumed" / mode, 1, *REFERENCE, *extra,
                                      f"checkpoint.resume={step2}"))
        assert str(resumed["resumed_from"]).endswith("step-00000002"), mode
        assert_same_finish(f"{mode}/ep2 resumed at ep1", resumed, refs[mode])


@pytest.mark.slow  # a world of 2 gloo processes
def test_expert_parallel_mixtral_with_aux_loss(mixtral_with_aux, tmp_path):  # noqa: F811
    """Mixtral's block (fp32 router weights) at ep2 with the router auxiliary loss in the objective.
    The auxiliary loss is a micro-batch's (not a sum over its tokens), so micro-batches are single
    rows here: each is the same micro-batch on every layout, weighted by its share of the step."""
    model = mixtral_with_aux
    single = ["training.micro_batch_size=1"]
    refs = {mode: trainer.run(moe_recipe(model, tmp_path / "ref" / mode, 1, *single, "training.grad_accum=4", *extra))
            for mode, extra in MODES.items()}
    ep2 = ["parallel.ep=2", *single, "training.grad_accum=2"]
    names = [f"mixtral/{mode}/ep2" for mode in MODES]
    dicts = [moe_recipe(model, tmp_path / mode / "ep2", 2, *ep2, *extra).to_dict() for mode, extra in MODES.items()]
    results = launch(run_layouts, 2, dicts, start_method="fork")
    for name, got in zip(names, results[0], strict=True):
        ref = refs[name.split("/")[1]]
        assert got is not None and all("aux_loss" in h for h in got["history"]), name
        aux = [torch.tensor([h["aux_loss"] for h in s["history"]]) for s in (got, ref)]
        assert torch.allclose(aux[0], aux[1], rtol=1e-5, atol=0), (name, aux)
        assert_same_curves(name, got, ref, STEPS)
        assert_same_files(name, got, ref)


def test_aux_loss_reaches_the_router_through_recomputed_layers(mixtral_with_aux, tmp_path):  # noqa: F811
    """One process: with every layer recomputed in backward the router auxiliary loss trains as
    without (the checkpointed layers record the graph its router logits need)."""
    runs = [trainer.run(moe_recipe(mixtral_with_aux, tmp_path / rc, 1, "training.micro_batch_size=1",
                                "training.grad_accum=4", *MODES["lora"], f"parallel.activation_checkpointing={rc}"))
            for rc in ("none", "full")]
    assert_same_curves("recomputed", runs[1], runs[0], STEPS)
    assert_same_files("recomputed", runs[1], runs[0])


def _load_held_experts(rank: int, world: int, model_dir: str) -> dict:
    """Worker: this ep rank's model read from ``model_dir`` (tiny Qwen3-MoE whose experts 3-5 are
    damaged in the file): rank 0 holds experts 0-2 and never reads the others; rank 1 does."""
    state = ParallelState(Layout.for_world(world, ep=2))
    model = build_model(DecoderConfig.from_hf(model_dir))
    apply_expert_parallel(model, state)
    try:
        materialize(model, model_dir, reader=make_slice_reader(model))
    except ModelLoadError as e:
        return {"error": str(e)}
    experts = model.model.layers["0"].mlp.experts
    return {"held": list(experts.held), "shape": tuple(experts.gate_up_proj.shape)}


def test_each_ep_rank_reads_only_its_experts(tmp_path):
    model = tmp_path / "moe"
    build_tiny_moe(tiny_moe_config("qwen3_moe"), model)
    tensors = load_file(model / "model.safetensors")
    for e in (3, 4, 5):  # a shape no expert has: whoever reads them fails
        key = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        tensors[key] = tensors[key][:-1]
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="differ in shape"):
        materialize(build_model(DecoderConfig.from_hf(model)), model)  # one process reads every expert
    results = run_world(_load_held_experts, 2, tmp_path, str(model))
    assert results[0] == {"held": [0, 1, 2], "shape": (3, 64, 64)}
    assert "differ in shape" in results[1]["error"]


def test_ep_is_carved_out_of_dp():
    """``ep`` splits ``dp`` into ``edp x ep`` (ep innermost); ``dp`` stays the whole data group."""
    lay = Layout.for_world(8, tp=2, ep=2)
    assert lay == Layout.of(dp=4, tp=2, ep=2)
    assert lay.names == ("pp", "edp", "ep", "tp") and lay.data_axes == ("edp", "ep")
    assert (lay.degree("dp"), lay.degree("edp"), lay.degree("ep")) == (4, 2, 2)
    assert lay.groups("ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp") == Layout.of(dp=4, tp=2).groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [lay.coords(r)["dp"] for r in range(0, 8, 2)] == [0, 1, 2, 3]
    assert lay.group_ranks("dp", 5) == [1, 3, 5, 7]
    assert Layout.of(dp=4, ep=1) == Layout.of(dp=4)  # ep 1: the layout without it
    with pytest.raises(NxdError, match=r"^parallel.ep=3 does not divide the data-parallel degree dp=4 "):
        Layout.of(dp=4, ep=3)


def test_received_rows_regroup_by_expert():
    """Rows laid out by [source, expert] blocks (2 sources x 2 held experts) regrouped by [expert, source]."""
    blocks = torch.tensor([[1, 2], [3, 0]])
    assert regroup_by_expert(blocks).tolist() == [0, 3, 4, 5, 1, 2]
    assert regroup_by_expert(torch.zeros(2, 3, dtype=torch.long)).tolist() == []

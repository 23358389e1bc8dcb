"""Checkpoints reshard: saved at one parallel layout, loaded at another, on real gloo groups (CPU).

A tiny LoRA Llama is trained 2 steps in one process (AdamW) and saved (``ref``), then trained one
more step (the reference continuation). In one 2-process launch (fork) each layout --
tp=2 (TP plan applied by ``initialize_parallel_model``), dp=2 with ZeRO-1, pp=2 (1F1B) -- loads
``ref`` and the checkpoints the other layouts saved, and checks:

- the loaded parameters and optimizer states, gathered back to full tensors (``gather_full``
  for TP, ``export_param_states`` for ZeRO-1, stage by stage for PP), equal the checkpoint's
  tensors exactly;
- one more training step in that layout gives the reference continuation (to 1e-5): the
  optimizer state (moments, step count, lr) is equivalent, not just present;
- it then saves its own checkpoint (step 3), which the next layouts and, at the end, one plain
  process (tp=1) load and check the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from nxd_finetune.api import (
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)
from nxd_finetune.checkpoint import CheckpointManager
from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.loss import causal_lm_loss
from nxd_finetune.loss import vocab_parallel_cross_entropy as vp_cross_entropy
from nxd_finetune.models import DecoderConfig, DecoderForCausalLM
from nxd_finetune.parallel import Layout as ParallelLayout
from nxd_finetune.parallel import ParallelState, gather_full, iter_placements
from nxd_finetune.parallel.launch import init_distributed, launch
from nxd_finetune.parallel.pipeline import PipelineRunner, build_stages

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights="gaussian")
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
LABELS = torch.where(torch.arange(12) < 3, -100, IDS)
N_TARGETS = (LABELS[:, 1:] != -100).sum()
VARIANTS = ("lora", "full-tied")
LAYOUTS = ("tp2", "dp2-zero1", "pp2")
OPT = dict(lr=1e-2, eps=1e-4)  # eps: keep 1e-7 summation-order differences from growing in Adam's update

pytestmark = pytest.mark.usefixtures("one_thread_and_tmpdir")


def base_model(tied: bool = False) -> DecoderForCausalLM:
    torch.manual_seed(0)
    return DecoderForCausalLM(DecoderConfig(**TINY, tie_word_embeddings=tied))


def make_model(variant: str) -> DecoderForCausalLM:
    """``lora``: LoRA on every linear; ``full-tied``: full SFT with tied embeddings."""
    model = base_model(tied=variant == "full-tied")
    if variant == "lora":
        inject_lora(model, LORA)
    return model


def ckpt_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read with safetensors directly (not through the manager)."""
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(manifest["tensors"].values())):
        out.update(load_file(path / name))
    return out


def trainable(modules) -> dict[str, torch.nn.Parameter]:
    return {n: p for m in modules for n, p in m.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------- per-layout pieces


class Layout:
    """A model in one parallel layout: ``modules``, ``optimizer``, one training step, and its state
    gathered back to full tensors keyed as in a checkpoint."""

    def __init__(self, kind: str, variant: str) -> None:
        self.kind = kind
        if kind == "pp2":
            self.state = ParallelState(ParallelLayout.of(pp=2))
            model = make_model(variant)
            self.modules = build_stages(model, self.state)
            self.runner = PipelineRunner(self.modules, self.state, "1f1b", n_microbatches=2)
            self.optimizer = torch.optim.AdamW(list(trainable(self.modules).values()), **OPT)
            return
        config = neuronx_distributed_config(
            tensor_parallel_size=2 if kind == "tp2" else 1, lora_config=LORA if variant == "lora" else None,
            optimizer_config={"zero_one_enabled": kind == "dp2-zero1", "grad_clipping": False,
                              "grad_reduction": "sum"})
        self.state = config.state
        model = initialize_parallel_model(config, base_model, variant == "full-tied")
        self.modules = [model]
        self.optimizer = initialize_parallel_optimizer(config, torch.optim.AdamW,
                                                       list(trainable(self.modules).values()), **OPT)

    def step(self) -> None:
        st = self.state
        if self.kind == "pp2":
            mbs = [{"input_ids": IDS[i : i + 1], "labels": LABELS[i : i + 1]} for i in range(2)]
            self.runner.step(mbs, N_TARGETS)
        elif self.kind == "tp2":
            logits = self.modules[0](IDS)
            (vp_cross_entropy(logits[:, :-1], LABELS[:, 1:], st.group("tp")).sum() / N_TARGETS).backward()
        else:  # dp2: one row per rank, losses over the global target count, gradients summed
            rows = slice(st.coord("dp"), st.coord("dp") + 1)
            (causal_lm_loss(self.modules[0](IDS[rows]), LABELS[rows], reduction="sum") / N_TARGETS).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def full_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and optimizer states as full tensors (TP-gathered, ZeRO-1
        consolidated); under PP only this stage's."""
        params = trainable(self.modules)
        specs = {n: s for m in self.modules for n, _, _, s in iter_placements(m)}

        def full(name: str, t: torch.Tensor) -> torch.Tensor:
            return (gather_full(t, specs[name], self.state) if name in specs else t).detach().clone()

        out = {f"param/{n}": full(n, p) for n, p in params.items()}
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if self.kind == "dp2-zero1":
            states = {id(p): {k: v for k, v in s.items() if k != "master"} for p, s in inner.export_param_states()}
        else:
            states = {id(p): inner.state[p] for p in params.values()}
        for n, p in params.items():
            for k, v in states[id(p)].items():
                out[f"optim/{n}/{k}"] = v.clone() if v.dim() == 0 else full(n, v)
        return out


def _check_load(out: dict, tag: str, layout: Layout, path: str, expected: dict) -> None:
    mgr = CheckpointManager(Path(path).parent, state=layout.state)
    ref = mgr.resolve(path)
    extra = mgr.load(ref, layout.modules, layout.optimizer)
    saved = ckpt_tensors(path)
    got = layout.full_state()
    for key, value in got.items():
        twin = key.replace("lm_head.weight", "model.embed_tokens.weight")  # tied copy of a pp stage
        out[f"{tag}: loaded {key}"] = ("equal", value, saved[key] if key in saved else saved[twin])
    out[f"{tag}: extra"] = ("equal", torch.tensor(extra["step"]), torch.tensor(ref.step))
    out[f"{tag}: lr restored"] = ("equal", torch.tensor(layout.optimizer.param_groups[0]["lr"]),
                                  torch.tensor(extra["lr"]))
    layout.step()
    after = layout.full_state()
    for name in trainable(layout.modules):
        want = f"step{ref.step + 1}/{name}"
        want = want if want in expected else want.replace("lm_head.weight", "model.embed_tokens.weight")
        out[f"{tag}: next step {name}"] = ("close", after[f"param/{name}"], expected[want])


def _reshard_worker(root: str) -> dict:
    init_distributed()
    torch.set_num_threads(1)
    out: dict = {}
    for variant in VARIANTS:
        expected = load_file(f"{root}/{variant}/expected.safetensors")
        ref_ckpt, saved = f"{root}/{variant}/ref/step-00000002", {}
        for kind in LAYOUTS:
            for source in (*saved, "ref"):
                layout = Layout(kind, variant)
                _check_load(out, f"{variant} {kind} <- {source}", layout, saved.get(source, ref_ckpt), expected)
            # save what this layout trained (ref + one step, just checked) for the next layouts and the parent
            mgr = CheckpointManager(f"{root}/{variant}/{kind}", state=layout.state)
            lr = layout.optimizer.param_groups[0]["lr"]
            saved[kind] = mgr.save(3, layout.modules, layout.optimizer, {"step": 3, "lr": lr})
    dist.barrier()
    dist.destroy_process_group()
    return out


def assert_checks(results: list[dict]) -> int:
    n = 0
    for rank, checks in enumerate(results):
        for name, (kind, got, expected) in checks.items():
            if kind == "equal":
                assert got.dtype == expected.dtype and torch.equal(got, expected), f"rank {rank}, {name}"
            else:
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, r=rank, c=name: f"rank {r}, {c}: {m}")
            n += 1
    return n


def reference(root: Path, variant: str) -> tuple[dict, dict]:
    """One process: 2 scheduled steps, save ``ref`` at step 2, then 2 more steps at the saved lr.
    Returns the parameters after every step (``step<k>/<name>``) and the optimizer state after 3."""
    model = make_model(variant)
    params = trainable([model])
    opt = torch.optim.AdamW(list(params.values()), **OPT)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    expected, state3 = {}, {}
    for step in range(1, 5):
        (causal_lm_loss(model(IDS), LABELS, reduction="sum") / N_TARGETS).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step <= 2:
            sched.step()
        if step == 2:
            CheckpointManager(root / "ref").save(2, [model], opt, {"step": 2, "lr": opt.param_groups[0]["lr"]})
        if step == 3:
            state3 = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
        expected.update({f"step{step}/{n}": p.detach().clone() for n, p in params.items()})
    assert opt.param_groups[0]["lr"] == 2.5e-3
    save_file(expected, root / "expected.safetensors")
    return expected, state3


def test_checkpoints_reshard_between_tp2_dp2_zero1_pp2_and_one_process(tmp_path):
    refs = {variant: reference(tmp_path / variant, variant) for variant in VARIANTS}
    results = launch(_reshard_worker, 2, str(tmp_path), start_method="fork")
    n = assert_checks(results)
    assert n > 800, n
    # sanity of the harness: one rank of pp2 holds layer 0, the other layer 1 (+ lm_head)
    assert any("lora pp2 <- ref: loaded param/model.layers.1" in k for k in results[1])
    assert not any("lora pp2 <- ref: loaded param/model.layers.1" in k for k in results[0])
    # tied embeddings at pp2: the last stage's lm_head copy came from model.embed_tokens.weight
    assert "full-tied pp2 <- ref: loaded param/lm_head.weight" in results[1]
    assert "param/lm_head.weight" in ckpt_tensors(tmp_path / "full-tied" / "pp2" / "step-00000003")

    # every layout's step-3 checkpoint loads in one plain process (tp=1) and equals the reference
    for variant, (expected, state3) in refs.items():
        for kind in LAYOUTS:
            fresh = make_model(variant)
            fresh_opt = torch.optim.AdamW(list(trainable([fresh]).values()), **OPT)
            mgr = CheckpointManager(tmp_path / variant / kind)
            extra = mgr.load(mgr.resolve("latest"), [fresh], fresh_opt)
            assert extra == {"step": 3, "lr": 2.5e-3}
            for name, p in trainable([fresh]).items():
                where = f"{variant} {kind} {name}"
                torch.testing.assert_close(p.detach(), expected[f"step3/{name}"], atol=1e-5, rtol=1e-5, msg=where)
                st = fresh_opt.state[p]
                assert st["step"] == state3[name]["step"] == 3
                for k in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(st[k], state3[name][k], atol=1e-6, rtol=1e-5, msg=f"{where} {k}")

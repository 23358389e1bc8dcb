"""The Lightning interface against ``nxd-finetune run`` (real Lightning ``Trainer``, real gloo groups).

The reference is the single-process ``trainer.run`` of the quickstart recipe with the overrides of
tests/test_parallel_run.py (4 packed rows of 64 tokens per optimizer step, fp32, AdamW eps 1e-6),
20 steps, checkpointing at step 10. Each Lightning run trains the same recipe through
``NxdLightningModule`` + ``NxdStrategy`` on the same global batch and is read back from its
``CSVLogger`` file (what a Lightning user sees): the loss curve within 1e-5 relative, the gradient
norms within 1e-4, the token counts equal, the exported adapter equal to the run's (2e-5), for
one process (in this process), tp=2 and dp=2 with ZeRO-1 (``Trainer(devices=2)``, Lightning's own
fork launcher). Checkpoints at step 10: the one-process Lightning run resumes from its own, a
Lightning run (dp=2, ZeRO-1) from the run's, and ``run`` from the tp=2 Lightning run's (tp 2 -> 1);
the steps after 10 are the reference's. The one-process adapter loads in ``peft`` with logits equal to the CLI's.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("lightning")

from nxd_finetune.errors import NxdError  # noqa: E402
from nxd_finetune.recipe import load_recipe  # noqa: E402
from nxd_finetune.sft import trainer  # noqa: E402
from tests.moe_helpers import moe_with_tokenizer  # noqa: E402, F401  (a fixture)
from tests.moe_helpers import train as moe_train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS, MID = 20, 10
BASE = ["data.max_seq_len=64", f"training.max_steps={STEPS}", "training.micro_batch_size=2", "training.warmup_steps=2",
        "training.eps=1e-6", "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null",
        "checkpoint.every_n_steps=null"]

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Lightning's launcher sets MASTER_PORT (and may set more) in this process: put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """This process trains with one thread, as Lightning's forked workers do: on a busy 2-core
    machine two OpenMP threads per process mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(quickstart_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return trainer.run(load_recipe(QUICKSTART, [*BASE, "training.grad_accum=2", f"checkpoint.every_n_steps={MID}",
                                                "checkpoint.keep_last=2", f"output.dir={out}"]))


def _fit(out: Path, devices: int, overrides: list[str], ckpt_path: str | None = None, max_steps: int = STEPS,
         precision: str = "32-true", checkpoint_every: int | None = None, tensorboard: bool = False,
         validate_every: int | None = None, **strategy):
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from nxd_finetune.lightning import NxdLightningModule, NxdModelCheckpoint, NxdStrategy

    module = NxdLightningModule(QUICKSTART, [*BASE, *overrides, f"output.dir={out}"])
    loggers = [CSVLogger(out, name="csv", version="")]
    if tensorboard:
        loggers.append(TensorBoardLogger(out, name="tb", version=""))
    callbacks = [NxdModelCheckpoint(out / "checkpoints", every_n_train_steps=checkpoint_every)] if checkpoint_every \
        else []
    pl.Trainer(devices=devices, accelerator="cpu", strategy=NxdStrategy(start_method="fork", **strategy),
               precision=precision, max_steps=max_steps, logger=loggers, log_every_n_steps=1, callbacks=callbacks,
               enable_checkpointing=bool(callbacks), enable_model_summary=False, enable_progress_bar=devices == 1,
               limit_val_batches=1.0 if validate_every else 0, val_check_interval=validate_every,
               num_sanity_val_steps=0).fit(module, ckpt_path=ckpt_path)
    return module


def _logged(out: Path) -> dict[int, dict[str, float]]:
    """The CSVLogger's rows by optimizer step (Lightning logs step N at its row N - 1; training and
    validation metrics of a step may be separate rows)."""
    logged: dict[int, dict[str, float]] = {}
    for r in csv.DictReader(open(out / "csv" / "metrics.csv")):
        logged.setdefault(int(r["step"]) + 1, {}).update(
            {k: float(v) for k, v in r.items() if v not in ("", None) and k != "step"})
    return logged


def _check_curve(name: str, got: dict[int, dict[str, float]], reference: dict, steps: range) -> None:
    ref = {h["step"]: h for h in reference["history"]}
    assert sorted(got) == list(steps), (name, sorted(got))
    for key, rtol in (("train_loss", 1e-5), ("grad_norm", 1e-4)):
        a = torch.tensor([got[s][key] for s in steps], dtype=torch.float64)
        b = torch.tensor([ref[s][key] for s in steps], dtype=torch.float64)
        assert torch.allclose(a, b, rtol=rtol, atol=0), (name, key, a.tolist(), b.tolist())
    assert [int(got[s]["tokens"]) for s in steps] == [ref[s]["tokens"] for s in steps], name
    assert all(got[s]["tokens_per_s"] > 0 and got[s]["lr"] == pytest.approx(ref[s]["lr"], rel=1e-6) for s in steps)


def _check_adapter(name: str, final: Path, reference: dict, atol: float) -> None:
    got, ref = (load_file(Path(d) / "adapter_model.safetensors") for d in (final, reference["output"]))
    assert got.keys() == ref.keys(), name
    for k in ref:
        assert (got[k] - ref[k]).abs().max().item() <= atol, (name, k)


def test_one_process_matches_run_and_its_adapter_loads_in_peft(reference, tmp_path):
    """Trainer(devices=1): the run's curve and final eval, CSV and TensorBoard loggers, a resume from
    its own checkpoint, and an adapter that peft loads with the CLI adapter's logits."""
    import peft
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    from nxd_finetune.data.inputs import resolve_model_dir

    out = tmp_path / "one"
    _fit(out, 1, ["training.grad_accum=2"], tensorboard=True, checkpoint_every=MID, validate_every=STEPS)
    logged = _logged(out)
    _check_curve("1 process", logged, reference, range(1, STEPS + 1))
    for key in ("eval_loss", "eval_accuracy"):  # the validation loop after step 20: the run's eval after training
        assert logged[STEPS][key] == pytest.approx(reference["eval_after"][key], rel=1e-5), key
    _check_adapter("1 process", out / "final", reference, atol=0.0)
    again = tmp_path / "one-resumed"  # from its own checkpoint
    _fit(again, 1, ["training.grad_accum=2"], ckpt_path=str(out / "checkpoints" / f"step-{MID:08d}"))
    _check_curve("1 process resumed", _logged(again), reference, range(MID + 1, STEPS + 1))
    _check_adapter("1 process resumed", again / "final", reference, atol=0.0)
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert {"train_loss", "lr", "grad_norm", "tokens_per_s"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("train_loss")) == STEPS

    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))

    def logits(adapter: Path) -> torch.Tensor:
        base = AutoModelForCausalLM.from_pretrained(resolve_model_dir("builtin:tiny-llama"), dtype=torch.float32)
        with torch.no_grad():
            return peft.PeftModel.from_pretrained(base, adapter).eval()(ids).logits

    torch.testing.assert_close(logits(out / "final"), logits(Path(reference["output"])), rtol=0, atol=0)


def test_two_process_layouts_match_run_and_checkpoints_cross_over(reference, tmp_path):
    """Trainer(devices=2) with tp=2 and with dp=2 + ZeRO-1 reproduce the run; a Lightning run
    resumes from the run's checkpoint and the run from a Lightning one."""
    tp2 = tmp_path / "tp2"
    _fit(tp2, 2, ["training.grad_accum=2"], checkpoint_every=MID, tensorboard=False, tensor_parallel_size=2)
    _check_curve("tp2", _logged(tp2), reference, range(1, STEPS + 1))
    _check_adapter("tp2", tp2 / "final", reference, atol=2e-5)
    lightning_ckpt = tp2 / "checkpoints" / f"step-{MID:08d}"
    manifest = json.loads((lightning_ckpt / "manifest.json").read_text())
    assert manifest["layout"]["tp"] == 2 and manifest["step"] == MID

    dp2 = tmp_path / "dp2-zero1"
    _fit(dp2, 2, ["training.grad_accum=1"], zero1=True)
    _check_curve("dp2-zero1", _logged(dp2), reference, range(1, STEPS + 1))
    _check_adapter("dp2-zero1", dp2 / "final", reference, atol=2e-5)

    run_ckpt = Path(reference["checkpoints"]) / f"step-{MID:08d}"
    resumed = tmp_path / "lightning-from-run"
    _fit(resumed, 2, ["training.grad_accum=1"], ckpt_path=str(run_ckpt), zero1=True)
    _check_curve("lightning dp2-zero1 from run", _logged(resumed), reference, range(MID + 1, STEPS + 1))
    _check_adapter("lightning dp2-zero1 from run", resumed / "final", reference, atol=2e-5)

    got = trainer.run(load_recipe(QUICKSTART, [*BASE, "training.grad_accum=2", f"output.dir={tmp_path / 'run'}",
                                               f"checkpoint.resume={lightning_ckpt}"]))
    assert got["resumed_from"] == str(lightning_ckpt)
    curve = {h["step"]: h for h in got["history"]}
    _check_curve("run from lightning tp2", curve, reference, range(1, STEPS + 1))  # 1..10 from the checkpoint
    _check_adapter("run from lightning tp2", Path(got["output"]), reference, atol=2e-5)


class _Steps:
    """An iterable of optimizer steps (a plain list would be read as several dataloaders)."""

    def __init__(self, steps: list) -> None:
        self.steps = steps

    def __iter__(self):
        return iter(self.steps)


def test_model_function_and_nxd_config_reproduce_run(reference, tmp_path):
    """NxdModelModule (model function + NxD config, NxD's NeuronLTModule) at tp=2 on the run's
    batches and schedule: the run's first 5 steps."""
    import functools

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from nxd_finetune.data.inputs import load_tokenizer, resolve_model_dir
    from nxd_finetune.data.loader import build_dataloaders
    from nxd_finetune.lightning import NxdModelModule, NxdStrategy
    from nxd_finetune.lora import LoraConfig
    from nxd_finetune.models import DecoderConfig, build_model
    from nxd_finetune.sft.schedule import lr_factor

    r = load_recipe(QUICKSTART, [*BASE, "training.grad_accum=2"])
    t, model_dir, n = r.training, resolve_model_dir(r.model.path), 5
    data = build_dataloaders(r.data, load_tokenizer(r, model_dir), micro_batch_size=t.micro_batch_size, dp_rank=0,
                             dp_world=1, seed=t.seed)
    it = iter(data.train)
    steps = _Steps([[next(it), next(it)] for _ in range(n)])
    config = {"tensor_parallel_size": 2, "optimizer_config": {"max_grad_norm": t.grad_clip},
              "model_init_config": {"meta_device_init": True, "checkpoint": str(model_dir)},
              "lora_config": LoraConfig.from_section(r.lora)}
    schedule = functools.partial(lr_factor, total_steps=STEPS, warmup_steps=t.warmup_steps, kind=t.scheduler,
                                 min_lr_ratio=t.min_lr_ratio)
    module = NxdModelModule(build_model, model_args=(DecoderConfig.from_hf(model_dir),),
                            opt_kwargs={"lr": t.lr, "betas": tuple(t.betas), "eps": t.eps, "weight_decay": 0.0},
                            scheduler_cls=torch.optim.lr_scheduler.LambdaLR, scheduler_kwargs={"lr_lambda": schedule},
                            seed=t.seed)
    pl.Trainer(devices=2, accelerator="cpu", strategy=NxdStrategy(nxd_config=config, start_method="fork"),
               max_steps=n, logger=CSVLogger(tmp_path, name="csv", version=""), log_every_n_steps=1,
               enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
               ).fit(module, train_dataloaders=steps)
    _check_curve("model function tp2", _logged(tmp_path), reference, range(1, n + 1))


@pytest.mark.parametrize("lightning_precision, run_precision", [("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16")])
def test_precision_plugin_runs_the_trainers_precision(quickstart_cache, tmp_path, lightning_precision, run_precision):
    """Trainer(precision=...) is the run's training.precision (2 steps, one process: bf16 is slow on CPU)."""
    steps = ["training.max_steps=2", "training.grad_accum=2"]
    ref = trainer.run(load_recipe(QUICKSTART, [*BASE, *steps, f"training.precision={run_precision}",
                                               f"output.dir={tmp_path / 'ref'}"]))
    module = _fit(tmp_path / "lt", 1, steps, max_steps=2, precision=lightning_precision)
    assert module.recipe.training.precision == run_precision
    dtype = {p.dtype for p in module.engine.trainable()}
    assert dtype == {torch.bfloat16 if run_precision == "bf16" else torch.float32}
    _check_curve(lightning_precision, _logged(tmp_path / "lt"), ref, range(1, 3))


def test_unsupported_layouts_and_precisions_are_one_line_errors(tmp_path):
    import lightning.pytorch as pl

    from nxd_finetune.lightning import NxdLightningModule, NxdPrecision, NxdStrategy

    with pytest.raises(NxdError, match="pipeline_parallel_size > 1 is not supported under Lightning"):
        NxdStrategy(pipeline_parallel_size=2)
    with pytest.raises(NxdError, match="pipeline_parallel_size > 1"):
        NxdStrategy(nxd_config={"tensor_parallel_size": 1, "pipeline_parallel_size": 2, "optimizer_config": {},
                                "sequence_parallel": False})
    with pytest.raises(NxdError, match="precision '16-mixed' is not supported"):
        NxdPrecision("16-mixed")
    assert NxdStrategy(nxd_config={"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "sequence_parallel": True,
                                   "optimizer_config": {"zero_one_enabled": True}}).zero1
    with pytest.raises(NxdError, match="nxd_config: unknown key"):
        NxdStrategy(nxd_config={"tensor_parallel_sise": 2})
    with pytest.raises(NxdError, match=r"3 process\(es\) are not divisible by tp\*pp = 2\*1"):
        pl.Trainer(devices=3, accelerator="cpu", strategy=NxdStrategy(tensor_parallel_size=2, start_method="fork"))
    module = NxdLightningModule(QUICKSTART, [f"output.dir={tmp_path}", f"output.registry={tmp_path / 'reg'}/x"])
    with pytest.raises(NxdError, match="output.registry is not published under Lightning"):
        pl.Trainer(devices=1, accelerator="cpu", strategy=NxdStrategy(), max_steps=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False).fit(module)
    module = NxdLightningModule(QUICKSTART, [f"output.dir={tmp_path}", "parallel.nproc=2", "parallel.ep=2"])
    with pytest.raises(NxdError, match="parallel.ep=2 is not supported under Lightning"):
        pl.Trainer(devices=1, accelerator="cpu", strategy=NxdStrategy(), max_steps=1, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False).fit(module)


def test_lightning_logs_aux_loss_as_run(moe_with_tokenizer, tmp_path):  # noqa: F811
    """The Lightning module's steps have ``run``'s ``aux_loss`` (in its history and its logger)."""
    config = moe_with_tokenizer / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "output_router_logits": True}))
    overrides = [f"model.path={moe_with_tokenizer}", "lora=null", "training.max_steps=2"]
    ref = moe_train(tmp_path / "run", moe_with_tokenizer, "lora=null", "logging.every_n_steps=1",
                "training.warmup_steps=2", "training.eps=1e-6")
    module = _fit(tmp_path / "lt", 1, overrides, max_steps=2)
    logged = _logged(tmp_path / "lt")
    want = [r["aux_loss"] for r in ref["history"] if "train_loss" in r]
    assert [r["aux_loss"] for r in module.history] == pytest.approx(want, rel=1e-5)
    assert [logged[s]["aux_loss"] for s in (1, 2)] == pytest.approx(want, rel=1e-5)

"""Beyond one process on the real launchers (real gloo groups, the quickstart's tiny Llama).

Elastic fault recovery: a 2-process tp=2 LoRA run whose rank 1 is SIGKILLed after step 3 (and, in
the restarted attempt, whose rank 0 is SIGKILLed during an asynchronous save of step 4) is
restarted by torch elastic, resumes from its newest complete checkpoint by itself and ends with the
adapter files byte-identical to an uninterrupted run's and a metrics file with every step once;
through our launcher (``launch(max_restarts=2)``, forked workers) and through ``torchrun
--max-restarts 1``. A failure in the same place every time stops after the restarts with one line
naming the rank and the cause (``nxd-finetune run --nproc 2 --max-restarts 1``).

Multi-node on one machine: two ``torchrun`` node groups (``--nnodes 2 --nproc-per-node 1``) with a
static ``--master-addr 127.0.0.1`` (tp=2 across the nodes) and with a c10d rendezvous (dp=2 +
ZeRO-1 across the nodes, a node's worker killed once and the job resumed across both nodes) each
reproduce the single-process loss curve; node 1 writes nothing to its own output directory. A world
whose size does not fit the recipe's layout fails before training with one line.

Failures are injected with ``NXD_FINETUNE_FAILPOINT`` (``<point>:<step>[:rank=R][:attempt=N]``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nxd_finetune.checkpoint.writer import FAILPOINT_ENV
from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.launch import free_port, launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS = 6
# the quickstart, shortened: 4 rows of 64 tokens per step (micro 2 x accum 2, or micro 2 x dp 2);
# LoRA dropout on, so the restored RNG states matter
BASE = ["data.max_seq_len=64", f"training.max_steps={STEPS}", "training.micro_batch_size=2", "training.warmup_steps=1",
        "training.eps=1e-6", "logging.progress=false", "logging.every_n_steps=1", "eval.max_batches=1",
        "eval.every_n_steps=3", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "lora.dropout=0.1"]
TP2 = ["parallel.tp=2", "training.grad_accum=2"]
DP2_ZERO1 = ["parallel.zero1=true", "training.grad_accum=1", "lora.dropout=0.0"]  # dropout masks differ per dp rank
ADAPTER = ("adapter_model.safetensors", "adapter_config.json")

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


def _train(recipe_dict: dict) -> dict | None:
    """Worker of the forked launches: one rank of the run."""
    torch.set_num_threads(1)
    return trainer.run_rank(recipe_from_dict(recipe_dict))


def _worker(recipe_dict: dict) -> dict | None:
    """``trainer._worker`` (what ``nxd-finetune run --nproc`` starts) on one thread: a forked child
    must not use the OpenMP pool its parent started (libgomp deadlocks after fork)."""
    torch.set_num_threads(1)
    return trainer._worker(recipe_dict)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(out: Path) -> list[tuple]:
    """(step, kind, value) of every loss logged, in file order."""
    return [(r["step"], k, r[k]) for r in records(out) for k in ("train_loss", "eval_loss") if k in r]


def train_losses(out: Path) -> list[float]:
    return [r["train_loss"] for r in records(out) if "train_loss" in r]


def assert_same_run(out: Path, ref: Path) -> None:
    """Byte-identical adapter, the same losses in the same order, every step logged once."""
    for name in ADAPTER:
        assert (out / "final" / name).read_bytes() == (ref / "final" / name).read_bytes(), name
    assert curve(out) == curve(ref)
    assert [r["step"] for r in records(out) if "train_loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records(out) if "eval_loss" in r] == [0, 3, 6]


def assert_curve_matches(out: Path, ref: Path) -> None:
    got, want = (torch.tensor(train_losses(d), dtype=torch.float64) for d in (out, ref))
    assert got.shape == want.shape == (STEPS,)
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got.tolist(), want.tolist())


@pytest.fixture(scope="module")
def env(quickstart_cache, tmp_path_factory):
    """The environment of subprocesses: the private cache with the tiny model, one thread."""
    tmp = tmp_path_factory.mktemp("subprocess-tmp")
    env = {**os.environ, "NXD_FINETUNE_CACHE": str(quickstart_cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(FAILPOINT_ENV, None)
    return env


@pytest.fixture(scope="module")
def references(quickstart_cache, tmp_path_factory) -> dict[str, Path]:
    """The single-process run (without LoRA dropout: every dp rank draws its own masks) and the
    uninterrupted 2-process tp=2 run with dropout (forked workers)."""
    out = tmp_path_factory.mktemp("references")
    trainer.run(load_recipe(QUICKSTART, [*BASE, "training.grad_accum=2", "lora.dropout=0.0",
                                         f"output.dir={out / 'single'}"]))
    tp2 = load_recipe(QUICKSTART, [*BASE, *TP2, "parallel.nproc=2", f"output.dir={out / 'tp2'}"])
    launch(_train, 2, tp2.to_dict(), start_method="fork")
    return {"single": out / "single", "tp2": out / "tp2"}


def torchrun(env: dict, *args: str, failpoint: str | None = None) -> subprocess.Popen:
    """``torchrun ARGS -m nxd_finetune run QUICKSTART ...`` as a subprocess (output in ``.stdout``)."""
    env = {**env, FAILPOINT_ENV: failpoint} if failpoint else env
    cmd = [sys.executable, "-m", "torch.distributed.run", "--monitor-interval", "0.1", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_args(out: Path, *overrides: str) -> list[str]:
    return ["-m", "nxd_finetune", "run", str(QUICKSTART), *BASE, f"output.dir={out}", *overrides]


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=timeout)
    return proc.returncode, output


# ----------------------------------------------------------------------------- 1. elastic restarts


def test_our_launcher_restarts_killed_ranks_and_resumes_to_the_identical_adapter(references, tmp_path, monkeypatch,
                                                                                 capfd):
    """Attempt 0: rank 1 is SIGKILLed after step 3 (saved: 2). Attempt 1 resumes from step 2 and
    rank 0 is SIGKILLed during the asynchronous save of step 4 (its stage files written, the
    manifest not). Attempt 2 resumes from step 2 again and finishes."""
    out = tmp_path / "run"
    recipe = load_recipe(QUICKSTART, [*BASE, *TP2, "parallel.nproc=2", "parallel.max_restarts=2",
                                      "checkpoint.async_save=true", f"output.dir={out}"])
    monkeypatch.setenv(FAILPOINT_ENV, "after-step:3:rank=1:attempt=0,before-manifest:4:rank=0:attempt=1")
    results = launch(_train, 2, recipe.to_dict(), start_method="fork", max_restarts=recipe.parallel.max_restarts)
    log = capfd.readouterr()
    assert log.out.count("resumed from") == 2, log.out[-3000:]
    assert results[0]["resumed_from"].endswith("step-00000002") and results[1] is None
    assert_same_run(out, references["tp2"])
    summary, ref = (json.loads((d / "summary.json").read_text()) for d in (out, references["tp2"]))
    def losses(s: dict) -> list[tuple]:
        return [(h["step"], h["train_loss"], h["lr"], h["grad_norm"], h["tokens"]) for h in s["history"]]

    assert losses(summary) == losses(ref) and summary["eval_after"] == ref["eval_after"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]


def test_torchx_local_cwd_torchrun_max_restarts_resumes_to_the_identical_adapter(references, env, tmp_path):
    """``torchx run --scheduler local_cwd components.py:finetune`` (TorchX's local scheduler runs
    the component's ``torchrun --max-restarts 1`` line here): rank 1 is SIGKILLed after step 5 in
    the first attempt; torchrun restarts both ranks, the run resumes from step 4 and ends with the
    uninterrupted run's adapter."""
    out = tmp_path / "run"
    bin_dir = str(Path(sys.executable).parent)  # torchx and torchrun of this environment
    env = {**env, FAILPOINT_ENV: "after-step:5:rank=1:attempt=0", "PATH": bin_dir + os.pathsep + env["PATH"]}
    component = ROOT / "nxd_finetune" / "cluster" / "components.py"
    proc = subprocess.run([os.path.join(bin_dir, "torchx"), "run", "--workspace", "", "--scheduler", "local_cwd",
                           "-cfg", f"log_dir={tmp_path / 'torchx-logs'}", f"{component}:finetune",
                           "--recipe", str(QUICKSTART), "--nproc_per_node", "2", "--max_restarts", "1",
                           "--", *BASE, *TP2, f"output.dir={out}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "Job finished: SUCCEEDED" in log and "(step 4)" in log, log[-4000:]
    assert_same_run(out, references["tp2"])


def test_a_failure_every_time_stops_after_the_restarts_with_one_line(tmp_path, monkeypatch, caplog):
    """Rank 1 dies at step 1 in every attempt: after ``max_restarts=1`` the launcher gives up with
    one line naming the rank and the cause."""
    recipe = load_recipe(QUICKSTART, [*BASE, *TP2, "parallel.nproc=2", "parallel.max_restarts=1",
                                      f"output.dir={tmp_path / 'run'}"])
    monkeypatch.setenv(FAILPOINT_ENV, "after-step:1:rank=1")
    with pytest.raises(NxdError) as e:
        launch(_worker, 2, recipe.to_dict(), start_method="fork", max_restarts=recipe.parallel.max_restarts)
    assert re.fullmatch(r"worker rank 1 failed: killed by signal SIGKILL( \(1 other rank\(s\) failed too\))?; "
                        r"gave up after 1 restart\(s\)", str(e.value)), str(e.value)
    assert not (tmp_path / "run" / "final").exists()
    # the agent's log: the first failure with its traceback, the repeat as one line
    failures = [r for r in caplog.records if r.name == "torch.distributed.elastic.multiprocessing.api"
                and r.getMessage().startswith("failed (exitcode")]
    assert len(failures) == 2 and failures[0].exc_info is not None and failures[1].exc_info is None, failures
    assert failures[1].getMessage().endswith(": process 1 terminated with signal SIGKILL"), failures[1].getMessage()


def test_launch_gives_up_after_max_restarts_with_the_last_attempts_cause(tmp_path):
    with pytest.raises(NxdError) as e:
        launch(_fail_in_attempt, 2, start_method="fork", max_restarts=2)
    assert str(e.value) == "worker rank 1 failed: ValueError: attempt 2 failed; gave up after 2 restart(s)"
    with pytest.raises(NxdError, match="max_restarts must be 0 or more, got -1"):
        launch(_fail_in_attempt, 2, max_restarts=-1)


def _fail_in_attempt() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} failed")


# ----------------------------------------------------------------------------- 2. multi-node


def two_nodes(env: dict, rdzv: list[str], outs: tuple[Path, Path], overrides: list[str],
              failpoint: str | None = None, restarts: int = 0) -> list[tuple[int, str]]:
    """Two ``torchrun --nnodes 2 --nproc-per-node 1`` node groups on this machine, node i writing
    to ``outs[i]`` (node 1's must stay empty: only global rank 0 writes outputs)."""
    procs = [torchrun(env, "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", str(restarts),
                      *(a.replace("NODE", str(i)) for a in rdzv), *run_args(outs[i], *overrides), failpoint=failpoint)
             for i in (0, 1)]
    return [finish(p) for p in procs]


def test_two_nodes_static_master_tp2_reproduces_the_single_process_curve(references, env, tmp_path):
    outs = (tmp_path / "node0", tmp_path / "node1")
    port = free_port()
    results = two_nodes(env, ["--node-rank", "NODE", "--master-addr", "127.0.0.1", "--master-port", str(port)],
                        outs, [*TP2, "lora.dropout=0.0", "checkpoint.every_n_steps=null"])
    for code, log in results:
        assert code == 0, log[-4000:]
    assert_curve_matches(outs[0], references["single"])
    assert (outs[0] / "final" / "adapter_model.safetensors").exists()
    assert not outs[1].exists() or not any(outs[1].rglob("*")), sorted(outs[1].rglob("*"))


def test_two_nodes_c10d_dp2_zero1_resumes_across_nodes(references, env, tmp_path):
    """dp=2 + ZeRO-1 across two c10d-rendezvous node groups; node 1's worker is SIGKILLed after
    step 3 once: both nodes restart, resume from step 2 of the shared checkpoint directory and
    finish with the single-process curve."""
    outs = (tmp_path / "node0", tmp_path / "node1")
    shared = tmp_path / "checkpoints"
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes"]
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # restarts across agents (see parallel.launch)
    results = two_nodes(env, rdzv, outs, [*DP2_ZERO1, f"checkpoint.dir={shared}"],
                        failpoint="after-step:3:rank=1:attempt=0", restarts=1)
    for code, log in results:
        assert code == 0, log[-4000:]
    assert "(step 2)" in results[0][1], results[0][1][-4000:]
    assert_curve_matches(outs[0], references["single"])
    assert [r["step"] for r in records(outs[0]) if "train_loss" in r] == list(range(1, STEPS + 1))
    summary = json.loads((outs[0] / "summary.json").read_text())
    assert summary["parallel"]["dp"] == 2 and summary["parallel"]["zero1"] and summary["resumed_from"]
    assert sorted(p.name for p in shared.iterdir()) == ["step-00000004", "step-00000006"]
    assert not outs[1].exists() or not any(outs[1].rglob("*")), sorted(outs[1].rglob("*"))


def test_a_world_that_does_not_fit_the_layout_fails_before_training(tmp_path, monkeypatch, capsys):
    """A worker of a 2-process torchrun world (its environment) with a tp=4 recipe: one line, exit 2."""
    from nxd_finetune.cli import main

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(QUICKSTART), "parallel.tp=4", f"output.dir={out}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("error: the launcher started 2 process(es) (WORLD_SIZE=2), which the recipe's layout does not "
                   "fit: override 'parallel.tp=4': parallel.nproc=2 is not divisible by tp*pp=4*1=4\n"), err
    assert not out.exists()


def test_a_rank_the_agent_stopped_is_not_the_root_cause(tmp_path):
    """Rank 1 was SIGKILLed; the agent then stopped rank 0 with SIGTERM, which torch elastic raises
    as SignalException into an error file that may be older than rank 1's whole-second stamp. The
    line names rank 1's kill (the order once depended on that timing: a flaky run named rank 0)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from nxd_finetune.parallel.launch import _failure_line

    stopped = tmp_path / "error.json"
    stopped.write_text(json.dumps({"message": {"message": "SignalException: Process 7 got signal: 15",
                                               "extraInfo": {"timestamp": "0", "py_callstack": ""}}}))
    os.utime(stopped, (1, 1))  # older than the kill's stamp (now)
    err = ChildFailedError("_worker", {0: ProcessFailure(0, 7, 1, str(stopped)),
                                       1: ProcessFailure(1, 8, -9, str(tmp_path / "none.json"))})
    assert _failure_line(err) == "worker rank 1 failed: killed by signal SIGKILL (1 other rank(s) failed too)"

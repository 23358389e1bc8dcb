"""The Trainium path without Trainium: the Neuron environment each precision preset produces, the
recipe's ``neuron`` section, run-time detection, the xla device backend's error paths, the
``precompile`` command (with a stand-in ``neuron_parallel_compile``), and the device hooks of the
training loop on CPU (prefetching loader, host reads). Needs no torch_xla; the same hooks on a real
XLA device are tested by ``make test-xla`` (tests/xla/)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
from pathlib import Path

import pytest
import torch

from nxd_finetune import neuron
from nxd_finetune.cli import main
from nxd_finetune.errors import NxdError, RecipeError
from nxd_finetune.neuron import apply_neuron_env, neuron_env, precompile_command
from nxd_finetune.neuron_presets import PRESETS, resolve_preset
from nxd_finetune.parallel import launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.runtime import DeviceLoader, StepRuntime, make_runtime

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def recipe(**sections):
    """A minimal valid recipe with ``sections`` merged in (``training={"precision": "bf16"}``...)."""
    data = {"model": {"path": "builtin:tiny-llama"}, "data": {"train": "/nonexistent.jsonl"}}
    for name, values in sections.items():
        data[name] = values
    return recipe_from_dict(data)


def env_of(environ=None, **sections) -> dict[str, str]:
    return neuron_env(recipe(**sections), {} if environ is None else environ)


# ---------------------------------------------------------------- presets


BASE = ["--model-type", "transformer"]


@pytest.mark.parametrize("training, parallel, preset, expected, flags", [
    ({"precision": "fp32"}, {}, "auto",
     {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
     [*BASE, "--auto-cast=none"]),
    ({"precision": "bf16"}, {}, "auto",
     {"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"}, BASE),
    ({"precision": "fp32"}, {}, "bf16-sr",
     {"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"}, BASE),
    ({"precision": "bf16"}, {"nproc": 2, "zero1": True}, "auto",
     {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
     [*BASE, "--auto-cast=none"]),
    ({"precision": "bf16-mixed"}, {}, "auto",
     {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
     [*BASE, "--auto-cast=none"]),
])
def test_each_preset_produces_its_environment(training, parallel, preset, expected, flags):
    env = env_of(training=training, parallel=parallel, neuron={"precision": preset})
    assert {k: v for k, v in env.items() if k != "NEURON_CC_FLAGS"} == expected
    assert shlex.split(env["NEURON_CC_FLAGS"]) == flags


def test_auto_resolves_from_training_precision_and_zero1():
    assert resolve_preset("fp32", False) == "fp32"
    assert resolve_preset("bf16", False) == "bf16-sr"
    assert resolve_preset("bf16", True) == "bf16-master"
    assert resolve_preset("bf16-mixed", True) == "autocast"
    assert set(PRESETS) == {"fp32", "bf16-sr", "bf16-master", "autocast"}


def test_stochastic_rounding_override():
    on = env_of(training={"precision": "fp32"}, neuron={"stochastic_rounding": True})
    off = env_of(training={"precision": "bf16"}, neuron={"stochastic_rounding": False})
    assert on["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1" and off["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"
    assert off["XLA_USE_BF16"] == "1"  # only the rounding changes


def test_cc_flags_keep_the_users_and_let_the_recipe_win(tmp_path):
    cache = tmp_path / "cache"
    user = "--log_level=INFO --cache_dir=/old --model-type generic --retry_failed_compilation"
    env = env_of({"NEURON_CC_FLAGS": user}, neuron={"compile_cache": str(cache), "cc_flags": ["-O1"]})
    assert shlex.split(env["NEURON_CC_FLAGS"]) == [
        "--log_level=INFO", "--retry_failed_compilation", "--model-type", "transformer",
        f"--cache_dir={cache}", "-O1", "--auto-cast=none"]


def test_an_auto_cast_flag_given_by_the_user_is_not_doubled():
    env = env_of({"NEURON_CC_FLAGS": "--auto-cast=matmult"})
    assert shlex.split(env["NEURON_CC_FLAGS"]) == ["--auto-cast=matmult", *BASE]
    env = env_of(neuron={"cc_flags": ["--auto-cast=all"]})
    assert shlex.split(env["NEURON_CC_FLAGS"]) == [*BASE, "--auto-cast=all"]


def test_model_type_null_and_no_cache_leave_the_users_flags_alone():
    env = env_of({"NEURON_CC_FLAGS": "--model-type=generic --cache_dir=/c"},
                 training={"precision": "bf16"}, neuron={"model_type": None})
    assert shlex.split(env["NEURON_CC_FLAGS"]) == ["--model-type=generic", "--cache_dir=/c"]


def test_relative_compile_cache_is_made_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = env_of(neuron={"compile_cache": "cc"})
    assert f"--cache_dir={tmp_path / 'cc'}" in shlex.split(env["NEURON_CC_FLAGS"])


def test_neuron_env_is_pure():
    environ = {"NEURON_CC_FLAGS": "--log_level=INFO"}
    before = dict(environ)
    env_of(environ)
    assert environ == before


# ---------------------------------------------------------------- recipe section


@pytest.mark.parametrize("overrides, message", [
    (["neuron.precision=bf16-master"], "neuron.precision=bf16-master needs training.precision=bf16 (got fp32)"),
    (["neuron.precision=bf16-master", "training.precision=bf16"],
     "neuron.precision=bf16-master keeps fp32 master weights in ZeRO-1; set parallel.zero1=true"),
    (["neuron.precision=autocast"], "neuron.precision=autocast needs training.precision=bf16-mixed (got fp32)"),
    (["neuron.precision=fp32", "training.precision=bf16"],
     "neuron.precision=fp32 needs training.precision=fp32 (got bf16)"),
    (["neuron.precision=bf16"], "neuron.precision: expected one of auto, fp32, bf16-sr, bf16-master, autocast"),
    (["neuron.compile_cach=/c"], "unknown key 'neuron.compile_cach' (did you mean 'neuron.compile_cache'?)"),
    (["neuron.model_type=''"], "neuron.model_type"),
    (["training.device=TPU"], "training.device='TPU' is not a device name: use auto, cpu, cuda, xla or a device"),
])
def test_recipe_rejects_bad_neuron_settings(overrides, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_recipe_accepts_the_neuron_section_and_keeps_the_cache_path_as_written():
    r = load_recipe(QUICKSTART, ["training.device=xla", "neuron.compile_cache=cache/neuron",
                                 "neuron.precision=bf16-sr", "neuron.stochastic_rounding=false"])
    assert r.training.device == "xla" and r.neuron.compile_cache == "cache/neuron"
    assert r.to_dict()["neuron"]["precision"] == "bf16-sr"


def test_unknown_preset_in_resolve_preset():
    with pytest.raises(NxdError, match="unknown neuron.precision 'fp8'"):
        resolve_preset("fp32", False, "fp8")


# ---------------------------------------------------------------- detection and application


def test_neuron_is_absent_here_and_placeholders_count_as_absent(tmp_path, monkeypatch):
    assert neuron.neuron_available() is False
    (tmp_path / "fake_neuron_placeholder.py").write_text("raise ImportError('placeholder package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert neuron._importable.__wrapped__("fake_neuron_placeholder") is False
    assert neuron._importable.__wrapped__("json") is True


def test_apply_neuron_env_only_on_neuron_for_xla_runs(monkeypatch):
    r = recipe(training={"device": "xla", "precision": "bf16"})
    environ: dict[str, str] = {}
    assert apply_neuron_env(r, environ) == {} and environ == {}  # no torch_neuronx here
    monkeypatch.setattr(neuron, "neuron_available", lambda: True)
    applied = apply_neuron_env(r, environ)
    assert environ == applied and applied["XLA_USE_BF16"] == "1"
    environ.clear()
    assert apply_neuron_env(recipe(training={"device": "cpu"}), environ) == {} and environ == {}
    assert apply_neuron_env(recipe(training={"device": "auto"}), environ)["XLA_USE_BF16"] == "0"


# ---------------------------------------------------------------- device backend


def test_device_names_and_process_group_backends(monkeypatch):
    assert launch.dist_backend_for("cpu") == "gloo"
    assert launch.dist_backend_for("cuda") == "nccl"
    assert launch.dist_backend_for("xla") == "xla"
    assert launch.resolve_device_name("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(neuron, "neuron_available", lambda: True)
    assert launch.resolve_device_name("auto") == "xla" and launch.dist_backend_for("auto") == "xla"
    with pytest.raises(NxdError, match="unknown device 'tpu'; use auto, cpu, cuda or xla"):
        launch.dist_backend_for("tpu")


@pytest.mark.skipif(neuron.torch_xla_available(), reason="torch_xla imports here")
def test_xla_device_without_torch_xla_is_one_clear_line():
    with pytest.raises(NxdError) as info:
        launch.device_backend("xla")
    text = str(info.value)
    assert "device xla (Trainium) is not available here: torch_xla does not import" in text
    assert "make test-xla" in text and "\n" not in text
    with pytest.raises(NxdError, match="torch_xla does not import"):
        launch.init_distributed("xla")
    with pytest.raises(NxdError, match="use gloo, nccl or xla"):
        launch.init_distributed("mpi")


# ---------------------------------------------------------------- precompile


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return info.value.code or 0, out.out, out.err


def test_precompile_without_neuron_is_one_line_and_exit_2(capsys):
    code, out, err = cli(capsys, "precompile", QUICKSTART)
    assert code == 2 and out == ""
    assert err.strip() == ("error: precompile needs the Neuron SDK (torch_neuronx and neuron_parallel_compile), "
                           "which is not installed here; run it on a Trainium instance (Neuron DLAMI or container)")


def test_precompile_checks_the_recipe_first(capsys):
    code, _, err = cli(capsys, "precompile", QUICKSTART, "neuron.precision=bf16-master")
    assert code == 2 and "neuron.precision=bf16-master needs training.precision=bf16" in err


def test_precompile_without_the_tool_on_path(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(neuron, "neuron_available", lambda: True)
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = cli(capsys, "precompile", QUICKSTART)
    assert code == 2 and "neuron_parallel_compile is not on PATH" in err


def fake_tool(tmp_path: Path, exit_code: int = 0) -> Path:
    """A stand-in ``neuron_parallel_compile`` that records its argv and Neuron variables."""
    tool = tmp_path / "bin" / "neuron_parallel_compile"
    tool.parent.mkdir()
    record = tmp_path / "record.json"
    tool.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv, 'env': {{k: v for k, v in os.environ.items() "
                    f"if k.startswith(('NEURON_', 'XLA_'))}}}}, open({str(record)!r}, 'w'))\n"
                    f"sys.exit({exit_code})\n")
    tool.chmod(0o755)
    return tool


def test_precompile_runs_the_recipe_under_neuron_parallel_compile(capsys, monkeypatch, tmp_path):
    tool = fake_tool(tmp_path)
    monkeypatch.setattr(neuron, "neuron_available", lambda: True)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--log_level=INFO")
    cache = tmp_path / "cache"
    code, out, err = cli(capsys, "precompile", QUICKSTART, f"neuron.compile_cache={cache}", "lora.rank=4",
                         "--steps", "3")
    assert code == 0, err
    rec = json.loads((tmp_path / "record.json").read_text())
    argv = rec["argv"]
    assert argv[1:6] == [sys.executable, "-m", "nxd_finetune", "run", str(QUICKSTART)]
    assert argv[6:8] == [f"neuron.compile_cache={cache}", "lora.rank=4"]
    ours = argv[8:]
    assert "training.device=xla" in ours and "training.max_steps=3" in ours
    assert "training.warmup_steps=3" in ours  # the quickstart's 10 clipped to the 3 steps
    assert "checkpoint.every_n_steps=null" in ours and "output.registry=null" in ours
    assert any(a.startswith("output.dir=") and "nxd-precompile-" in a for a in ours)
    flags = shlex.split(rec["env"]["NEURON_CC_FLAGS"])
    assert flags == ["--log_level=INFO", "--model-type", "transformer", f"--cache_dir={cache}", "--auto-cast=none"]
    assert rec["env"]["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"
    assert f"into {cache}" in out


def test_precompile_reports_a_failing_compile(capsys, monkeypatch, tmp_path):
    tool = fake_tool(tmp_path, exit_code=3)
    monkeypatch.setattr(neuron, "neuron_available", lambda: True)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    code, _, err = cli(capsys, "precompile", QUICKSTART)
    assert code == 2 and err.strip().endswith("neuron_parallel_compile exited with code 3")


def test_precompile_command_puts_our_overrides_last():
    r = load_recipe(QUICKSTART, ["training.warmup_steps=2"])
    argv = precompile_command("/t/npc", "recipes/quickstart.yaml", ["training.max_steps=99"], r, 5, "/o",
                              python="/py")
    assert argv[:6] == ["/t/npc", "/py", "-m", "nxd_finetune", "run", str(QUICKSTART)]
    assert argv.index("training.max_steps=5") > argv.index("training.max_steps=99")
    assert "training.warmup_steps=2" in argv and "output.dir=/o" in argv


# ---------------------------------------------------------------- device hooks on CPU


class Counter:
    """A resumable source: yields 0, 1, 2 ... (up to ``n``), ``state_dict()`` counts items drawn."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.drawn, self.fail_at = n, 0, fail_at

    def __iter__(self):
        while self.drawn < self.n:
            if self.drawn == self.fail_at:
                raise ValueError(f"bad item {self.drawn}")
            self.drawn += 1
            yield {"x": torch.tensor([self.drawn - 1])}, self.drawn - 1

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_device_loader_state_is_that_of_the_items_handed_out(prefetch):
    source = Counter(6)
    moved = []
    loader = DeviceLoader(source, lambda item: moved.append(threading.current_thread().name) or item,
                          prefetch=prefetch, snapshot=source.state_dict)
    assert loader.state_dict() == {"drawn": 0}
    got = []
    for i, (batch, n) in enumerate(loader):
        assert loader.state_dict() == {"drawn": i + 1}  # not the prefetched position
        got.append((int(batch["x"]), n))
    assert got == [(i, i) for i in range(6)]
    assert source.drawn == 6
    expected_thread = "nxd-device-loader" if prefetch else threading.current_thread().name
    assert set(moved) == {expected_thread}
    loader.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_device_loader_stands_in_for_the_resumable_loader(prefetch):
    source = Counter(8)

    def restore(state):
        source.drawn = state["drawn"]

    loader = DeviceLoader(iter(source), lambda x: x, prefetch=prefetch, snapshot=source.state_dict, restore=restore)
    assert loader.state_dict() == {"drawn": 0}
    loader.load_state_dict({"drawn": 5})  # a resume: before the first item
    assert loader.state_dict() == {"drawn": 5}
    assert [n for _, n in loader] == [5, 6, 7]
    with pytest.raises(NxdError, match="items were already drawn"):
        loader.load_state_dict({"drawn": 0})
    with pytest.raises(NxdError, match="no restore function"):
        DeviceLoader([], lambda x: x).load_state_dict({})
    with pytest.raises(NxdError, match="no snapshot function"):
        DeviceLoader([], lambda x: x).state_dict()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_device_loader_raises_the_sources_error_in_the_consumer(prefetch):
    loader = DeviceLoader(Counter(5, fail_at=2), lambda x: x, prefetch=prefetch)
    assert [n for _, n in (next(loader), next(loader))] == [0, 1]
    with pytest.raises(ValueError, match="bad item 2"):
        next(loader)
    loader.close()


def test_device_loader_close_stops_an_endless_prefetch():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    with DeviceLoader(endless(), lambda x: x, prefetch=2) as loader:
        assert [next(loader) for _ in range(3)] == [0, 1, 2]
    assert not loader._thread.is_alive()


def test_eager_runtime_reads_values_at_once_and_keeps_cpu_tensors():
    rt = make_runtime(torch.device("cpu"))
    assert type(rt) is StepRuntime and not rt.lazy
    seen = []
    rt.on_host(seen.append, {"loss": torch.tensor(1.5), "grad_norm": None})
    assert seen == [{"loss": 1.5, "grad_norm": None}]
    state = {"w": torch.ones(2)}
    assert rt.to_cpu(state)["w"] is state["w"]
    batches = list(rt.batches([({"a": torch.ones(1)}, 1)]))
    assert batches[0][1] == 1 and rt.report() == {}
    rt.end_step()
    rt.wait()


# ---------------------------------------------------------------- engine: full logits, host groups


def test_full_logits_gives_the_targets_only_loss_and_is_not_sequence_parallel():
    """``Engine.full_logits`` (set by ``XlaRuntime.prepare``): logits at every position, the same
    loss as the default gather of target positions; ``sequence_parallel`` keeps its own meaning."""
    from nxd_finetune.data.inputs import resolve_model_dir
    from nxd_finetune.loss import TARGET_ROWS_MULTIPLE, ce_sum
    from nxd_finetune.sft.engine import build_engine

    rec = load_recipe(QUICKSTART, ["training.max_steps=2", "training.warmup_steps=0"])
    engine = build_engine(rec, resolve_model_dir(rec.model.path), torch.device("cpu"), 2)
    assert not engine.full_logits and not engine.sequence_parallel
    torch.manual_seed(0)
    ids = torch.randint(0, engine.config.vocab_size, (2, 16))
    labels = ids.clone()
    labels[:, :5] = -100
    labels[1, 12:] = -100
    batch = {"input_ids": ids, "labels": labels}
    losses, shapes = [], []
    for full in (False, True):
        engine.full_logits = full
        with torch.no_grad():
            logits, targets = engine.logits_and_targets(batch)
        losses.append(ce_sum(logits, targets))
        shapes.append(tuple(logits.shape))
    # 11 + 7 targets, padded with ignored rows to a multiple of TARGET_ROWS_MULTIPLE, at most all 2 x 16 positions
    assert shapes == [(min(2 * 16, TARGET_ROWS_MULTIPLE), engine.config.vocab_size), (2, 16, engine.config.vocab_size)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)


def _host_groups_worker(out_dir: str) -> dict:
    """World 2 on gloo, pp=2: the call sites that exchange CPU tensors or objects, given gloo host
    groups of their own (what the xla and nccl backends get), use those groups and no other."""
    import signal
    from types import SimpleNamespace

    import torch.distributed as dist

    from nxd_finetune import export
    from nxd_finetune.checkpoint.manager import CheckpointManager
    from nxd_finetune.checkpoint.training import StopSignals, TrainingCheckpoints, rng_state
    from nxd_finetune.parallel.launch import init_distributed
    from nxd_finetune.parallel.parallelize import RankModel
    from nxd_finetune.parallel.state import Layout, ParallelState
    from nxd_finetune.sft import setup, trainer

    backend = init_distributed("gloo")
    rank = backend.rank
    state = ParallelState(Layout.for_world(2, tp=1, pp=2))
    # gloo: the main groups serve; separate_host: gloo groups of their own, as xla and nccl get
    sep = ParallelState(Layout.for_world(2, tp=1, pp=2), separate_host=True)
    host = SimpleNamespace(**{axis or "world": sep.host_group(axis) for axis in (None, "tp", "pp", "dp")})
    out: dict = {"shared": (state.host_group() is None, state.host_group("pp") is state.group("pp"),
                            state.host_group("tp") is state.group("tp")),
                 "backends": [dist.get_backend(g) for g in (host.world, host.tp, host.pp, host.dp)],
                 "separate": host.pp is not sep.group("pp") and host.world is not None}
    allowed = {id(g) for g in (host.world, host.tp, host.pp, host.dp)}
    used: list[str] = []

    def spy(name):
        real = getattr(dist, name)

        def call(*args, group=None, **kwargs):
            if id(group) not in allowed:  # None (the default group) or a main group
                raise AssertionError(f"dist.{name} on group {group!r}, not a host group")
            used.append(name)
            return real(*args, group=group, **kwargs)

        return call

    for name in ("all_reduce", "all_gather", "broadcast", "barrier", "gather_object"):
        setattr(dist, name, spy(name))
    torch.manual_seed(100 + rank)
    with setup.rank0_first(rank, host.world):
        pass
    signals = StopSignals()
    signals.signum = signal.SIGTERM if rank == 1 else None
    out["agreed"] = signals.agreed(state, host.world)
    signals.restore()
    rows = rng_state(state, host.world)["torch_cpu"]
    out["rng_rows_are_each_ranks"] = rows.shape[0] == 2 and torch.equal(rows[rank], torch.get_rng_state())
    engine = SimpleNamespace(state=sep, modules=[], runner=None)
    out["count"] = trainer._count(engine, [torch.nn.Parameter(torch.ones(3 + rank))])
    united = export._unite_stages(RankModel([], state), host.pp, {f"stage{rank}.w": torch.full((2,), float(rank))})
    out["united"] = None if united is None else {k: v.tolist() for k, v in sorted(united.items())}
    manager = CheckpointManager(out_dir, state=state, group=host.world)
    out["resolved"] = manager.resolve("latest")  # rank 0 looks, broadcasts -1: nothing saved
    out["broadcast"] = manager._broadcast_int(41 if rank == 0 else 0)
    recipe = SimpleNamespace(checkpoint=SimpleNamespace(dir=out_dir, every_n_steps=None, keep_last=1, resume=None))
    TrainingCheckpoints(recipe, SimpleNamespace(state=state), Path(out_dir), None, group=host.world)._barrier()
    out["used"] = sorted(set(used))
    dist.destroy_process_group()
    return out


def test_host_collectives_go_through_the_groups_they_are_given(tmp_path, monkeypatch):
    """The gloo routing of issue 7's multi-process XLA gap, on gloo (torch_xla's CPU device cannot
    run a multi-process world: docs/trainium.md)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    r0, r1 = launch.launch(_host_groups_worker, 2, str(tmp_path / "ckpt"), start_method="fork")
    for r in (r0, r1):
        assert r["shared"] == (True, True, True) and r["separate"]
        assert r["backends"] == ["gloo"] * 4
        assert r["agreed"] == signal_number("SIGTERM") and r["rng_rows_are_each_ranks"]
        assert r["count"] == 3 + 4  # one parameter per stage, summed over pp
        assert r["resolved"] is None and r["broadcast"] == 41
        assert r["used"] == ["all_gather", "all_reduce", "barrier", "broadcast", "gather_object"]
    assert r0["united"] == {"stage0.w": [0.0, 0.0], "stage1.w": [1.0, 1.0]} and r1["united"] is None


def signal_number(name: str) -> int:
    import signal

    return int(getattr(signal, name))

"""The frame the side-by-side benchmarks (``bench_moe.py``, ``bench_grpo.py``) share: their random
model under ``bench/.cache/models/``, a worker process's entry and memory readings, the figure
boilerplate, and writing a run's results (``.json``, ``.md``, ``.png``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
CACHE = Path(os.environ.get("NXD_BENCH_CACHE", BENCH / ".cache"))
MiB = 2**20
Result = dict[str, Any]  # a benchmark's JSON document (its rows, shape and conditions)


def ensure_model(name: str, config_class: str, shape: dict[str, Any], layers: int) -> Path:
    """``bench/.cache/models/<name>``: the quickstart tokenizer and a random-init (seed 0) model of
    transformers' ``config_class`` with ``shape`` and ``layers`` layers, fp32; written once (again
    when the shape changes)."""
    out = CACHE / "models" / name
    spec = {**shape, "num_hidden_layers": layers, "seed": 0, "version": 1}
    if (out / "bench_spec.json").is_file() and json.loads((out / "bench_spec.json").read_text()) == spec:
        return out
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    config = getattr(transformers, config_class)(vocab_size=len(tok), num_hidden_layers=layers,
                                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                 pad_token_id=tok.pad_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "bench_spec.json").write_text(json.dumps(spec))
    return out


def vm(key: str) -> int:
    """This process's ``/proc/self/status`` entry ``key`` (``VmHWM``, ``VmRSS``) in bytes; 0 without it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def run_as_worker(worker: Callable[[dict[str, Any]], dict[str, Any]]) -> bool:
    """When this process is a worker (``system.run_worker``: a JSON spec as the only argument): run
    ``worker`` on it with the spec's ``threads`` torch threads and print its ``RESULT`` line; True
    then, False for a command line of the benchmark itself."""
    if not (len(sys.argv) == 2 and sys.argv[1].startswith("{")):
        return False
    import torch

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    print("RESULT " + json.dumps(worker(spec)), flush=True)
    return True


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: ModuleType, fig: Any, axes: Any, labels: list[str], title: str, path: Path,
                **tick_options: Any) -> Path:
    """Label ``axes``' x ticks with ``labels`` (``tick_options``: rotation, alignment), title the
    figure and write it to ``path``."""
    x = list(range(len(labels)))
    for a in axes:
        a.set_xticks(x)
        a.set_xticklabels(labels, fontsize=7, **tick_options)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_result_args(ap: argparse.ArgumentParser, default_name: str) -> None:
    """``--note`` (a line under the title) and ``--out`` (the results' name, ``default_name`` by default)."""
    ap.add_argument("--note", default="", help="a line about the conditions, shown under the title")
    ap.add_argument("--out", default=None, help=f"results name under bench/results (default {default_name})")


def write_results(res: Result, name: str, render: Callable[[Result], str],
                  plot: Callable[[Result, Path, ModuleType], Path]) -> None:
    """``bench/results/<name>.{json,md,png}`` of ``res`` (the figure drawn by ``plot`` with
    ``matplotlib.pyplot``, none without matplotlib); the Markdown printed too."""
    out = RESULTS / name
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(res))
    plt = pyplot()
    if plt is not None:
        plot(res, out.with_suffix(".png"), plt)
    print(render(res))

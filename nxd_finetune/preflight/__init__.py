"""``nxd-finetune validate`` without the CLI: check a recipe before any worker starts and estimate
its memory per rank.

- :mod:`.data`: the first rows of every local data file against ``data.format`` / ``data.fields``;
- :mod:`.model`: model, tokenizer and checkpoint files, tensor names and shapes, parameter counts;
- :mod:`.memory`: the per-rank memory estimate (formulas in :func:`.memory.estimate_memory`);
- :mod:`.report`: :func:`run_checks` runs them all; :func:`print_report` / :func:`report_json`.

Heavy third-party imports (datasets, pyarrow, rich) happen inside the functions.
"""

from nxd_finetune.preflight.data import check_data
from nxd_finetune.preflight.memory import estimate_memory, human_bytes
from nxd_finetune.preflight.model import check_weights, count_parameters, find_model_dir
from nxd_finetune.preflight.report import Preflight, layout, print_report, report_json, run_checks

__all__ = [
    "Preflight",
    "check_data",
    "check_weights",
    "count_parameters",
    "estimate_memory",
    "find_model_dir",
    "human_bytes",
    "layout",
    "print_report",
    "report_json",
    "run_checks",
]

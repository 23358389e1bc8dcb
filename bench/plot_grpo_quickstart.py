"""The GRPO quickstart's reward curve (``recipes/quickstart-grpo.yaml``; the figure the README shows):
a run's ``metrics.jsonl`` and ``summary.json`` to ``bench/results/quickstart_grpo.{json,md,png}``.

    nxd-finetune run recipes/quickstart.yaml
    nxd-finetune run recipes/quickstart-grpo.yaml
    python bench/plot_grpo_quickstart.py outputs/quickstart-grpo --note "2 cores, idle"

Not a benchmark: it reads what the run logged (the mean reward of each step's 128 completions, its
standard deviation, the share of groups whose completions all scored the same) and draws it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/plot_grpo_quickstart.py`

from bench import runs  # noqa: E402

START_AT_MOST, END_AT_LEAST = 0.3, 0.9  # the quickstart's promise: the reward's first and last steps


def read_run(run: Path) -> runs.Result:
    """The per-step reward curve and the timings of the GRPO run that wrote ``run``."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward" in r]
    summary = json.loads((run / "summary.json").read_text())
    return {"run": str(run), "steps": [r["step"] for r in rows], "reward": [r["reward"] for r in rows],
            "reward_std": [r["reward_std"] for r in rows],
            "frac_reward_zero_std": [r["frac_reward_zero_std"] for r in rows],
            "time_to_first_step_s": summary["time_to_first_step_s"], "train_time_s": summary["train_time_s"]}


def window(res: runs.Result, first: int, last: int) -> float:
    """The mean reward over steps ``first`` to ``last``."""
    values = [r for s, r in zip(res["steps"], res["reward"], strict=True) if first <= s <= last]
    return sum(values) / len(values)


def render(res: runs.Result) -> str:
    steps, n = res["steps"], len(res["steps"])
    lines = ["# GRPO quickstart: mean reward per step", "", res["note"], "",
             f"{n} steps; {res['time_to_first_step_s']:.1f} s to the first step, then {res['train_time_s']:.0f} s "
             "of training (generation included).", "",
             f"- step 1: {res['reward'][0]:.3f} (promise <= {START_AT_MOST}); steps 1-10: {window(res, 1, 10):.3f}",
             f"- last 10 steps: mean {window(res, steps[-1] - 9, steps[-1]):.3f}, lowest "
             f"{min(res['reward'][-10:]):.3f} (promise >= {END_AT_LEAST}); last step {res['reward'][-1]:.3f}", "",
             "| steps | mean reward | groups all alike |", "| --- | --- | --- |"]
    for first in range(1, steps[-1] + 1, 10):
        last = min(first + 9, steps[-1])
        alike = [z for s, z in zip(steps, res["frac_reward_zero_std"], strict=True) if first <= s <= last]
        lines.append(f"| {first}-{last} | {window(res, first, last):.3f} | {sum(alike) / len(alike):.2f} |")
    return "\n".join(lines) + "\n"


def plot(res: runs.Result, path: Path, plt: ModuleType) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    steps, mean, std = res["steps"], res["reward"], res["reward_std"]
    low = [max(m - s, 0.0) for m, s in zip(mean, std, strict=True)]
    high = [min(m + s, 1.0) for m, s in zip(mean, std, strict=True)]
    ax.fill_between(steps, low, high, alpha=0.2, label="± std over the step's completions")
    ax.plot(steps, mean, lw=1.5, label="mean reward (exact match)")
    ax.axhline(START_AT_MOST, ls=":", c="grey", lw=1)
    ax.axhline(END_AT_LEAST, ls=":", c="grey", lw=1)
    ax.set_xlabel("GRPO step (16 prompts x 8 completions)")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("GRPO quickstart: 'Is the next number after N even or odd?'\n" + res["note"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the GRPO run's output.dir (outputs/quickstart-grpo)")
    runs.add_result_args(ap, "quickstart_grpo")
    args = ap.parse_args()
    res = read_run(args.run) | {"note": args.note}
    runs.write_results(res, args.out or "quickstart_grpo", render, plot)


if __name__ == "__main__":
    main()

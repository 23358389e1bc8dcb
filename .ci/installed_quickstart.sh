#!/usr/bin/env bash
# The quickstart as a user of the package runs it: build the wheel, install it (not editable) into a
# fresh venv, then run `nxd-finetune run builtin:quickstart` (shortened) from an empty directory
# outside the checkout. The recipe, its data and the tokenizer corpus must come from the wheel.
#   .ci/installed_quickstart.sh            (PYTHON / TORCH_SPEC as in the Makefile; STEPS, default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
STEPS=${STEPS:-5}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# the sources a wheel is built from (as in an sdist), so the build leaves the checkout untouched
mkdir -p "$work/src"
cp -r pyproject.toml README.md nxd_finetune "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +

"$PYTHON" -m venv "$work/venv"
venv=$work/venv/bin
# shellcheck disable=SC2086  # TORCH_SPEC may hold several words (an index URL)
"$venv/pip" install -q $TORCH_SPEC
"$venv/pip" wheel -q --no-deps -w "$work/dist" "$work/src"
"$venv/pip" install -q "$work"/dist/nxd_finetune-*.whl

mkdir -p "$work/run"
cd "$work/run"
installed=$("$venv/python" -c "import nxd_finetune; print(nxd_finetune.__file__)")
case $installed in
  "$work/venv/"*) ;;
  *) echo "error: nxd_finetune imported from $installed, not from the installed wheel" >&2; exit 1 ;;
esac
HF_HUB_OFFLINE=1 NXD_FINETUNE_CACHE="$work/cache" "$venv/nxd-finetune" run builtin:quickstart \
  "training.max_steps=$STEPS" "training.warmup_steps=1" "eval.every_n_steps=$STEPS" "logging.every_n_steps=1"
"$venv/python" - "$STEPS" <<'PY'
import json, math, sys
from pathlib import Path

out = Path("outputs/quickstart")
summary = json.loads((out / "summary.json").read_text())
assert summary["steps"] == int(sys.argv[1]), summary["steps"]
assert math.isfinite(summary["final_loss"]), summary["final_loss"]
assert (out / "final" / "adapter_config.json").is_file(), "no adapter in outputs/quickstart/final"
print(f"installed quickstart: {summary['steps']} steps, final loss {summary['final_loss']:.3f}")
PY

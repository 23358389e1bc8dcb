#!/usr/bin/env bash
# The GPU kit (docs/gpu.md): the one script a session with a lent GPU runs, from the repository root.
#
#   OUT=/some/dir bash bench/gpu/run.sh                 # on the GPU machine: every step time-boxed, < 5 min
#   OUT=/tmp/o KIT_PYTHON=.venv/bin/python KIT_WHEELS=/tmp/w \
#     bash bench/gpu/run.sh --cpu-dry-run               # the same steps on a CPU (tiny shapes), to test the kit
#
# Steps: install the carried wheels (.whl/, bench/gpu/wheels.sh) into $KIT_SITE; record the machine
# ($OUT/env.txt); the cuda-marked tests (tests/test_cuda.py, tests/test_flex_attention.py:
# $OUT/test_cuda.xml + .log); the GPU bench (bench/bench_gpu.py --out $OUT --budget-s: gpu_bench.json,
# gpu_bench.md; $OUT/bench.log). Each step's seconds and exit status go to $OUT/steps.txt. At most 7
# files, all directly under $OUT.
# Env: OUT (required), KIT_PYTHON (python3), KIT_WHEELS (.whl), KIT_SITE (/tmp/site; a fresh temp
# folder in a dry run), KIT_COMMIT (the commit being run, recorded in env.txt: the machine's copy
# has no .git), KIT_TESTS (the test files, space-separated), KIT_T_INSTALL / KIT_T_ENV / KIT_T_TEST /
# KIT_T_BENCH (seconds each step may take; KIT_T_BENCH=0 skips the bench).
# Exit status: 0 when every step exited 0, else 1 (every step runs regardless).
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY=0
case "${1:-}" in
  --cpu-dry-run) DRY=1 ;;
  "") ;;
  *) echo "error: unknown argument ${1} (use --cpu-dry-run or nothing)" >&2; exit 2 ;;
esac
if [ -z "${OUT:-}" ]; then echo "error: set OUT to the folder the results go to" >&2; exit 2; fi
PY=${KIT_PYTHON:-python3}
WHEELS=${KIT_WHEELS:-.whl}
if [ "$DRY" = 1 ]; then
  DEVICE=cpu BENCH_ARGS=(--device cpu --tiny) LIMIT=900
  if [ -z "${KIT_SITE:-}" ]; then
    SITE=$(mktemp -d /tmp/nxd-kit-site.XXXXXX)
    trap 'rm -rf "$SITE"' EXIT
  else
    SITE=$KIT_SITE
  fi
else
  DEVICE=cuda BENCH_ARGS=() LIMIT=
  SITE=${KIT_SITE:-/tmp/site}
fi
# the GPU machine's budget: 20 + 25 + 170 + 220 = 435 s at most (the bench needs ~3-4 min on one H100, an estimate)
T_INSTALL=${KIT_T_INSTALL:-${LIMIT:-20}}
T_ENV=${KIT_T_ENV:-${LIMIT:-25}}
T_TEST=${KIT_T_TEST:-${LIMIT:-170}}
T_BENCH=${KIT_T_BENCH:-${LIMIT:-220}}

mkdir -p "$OUT"
rm -f "$OUT/test_cuda.log" "$OUT/test_cuda.xml" "$OUT/bench.log"  # a rerun into the same folder starts clean
STEPS="$OUT/steps.txt"
echo "# bench/gpu/run.sh $([ "$DRY" = 1 ] && echo "--cpu-dry-run ")device=$DEVICE python=$PY $(date -u +%FT%TZ)" > "$STEPS"
FAILED=0
T0=$(date +%s.%N)

since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME LIMIT LOG CMD...: run CMD under `timeout LIMIT`, its output appended to LOG; one line in steps.txt
step() {
  local name=$1 limit=$2 log=$3 t rc
  shift 3
  t=$(date +%s.%N)
  timeout -k 5 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || FAILED=1
  local note=""
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && note="  TIMED OUT"
  printf '%-8s %7s s  rc=%-3s limit=%s s%s\n' "$name" "$(since "$t")" "$rc" "$limit" "$note" >> "$STEPS"
}

# 1. the wheels the machine lacks, as the device README installs them
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  step install "$T_INSTALL" "$STEPS" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" "$WHEELS"/*.whl
else
  echo "install: no wheels in $WHEELS (run bench/gpu/wheels.sh and carry .whl)" >> "$STEPS"
  FAILED=1
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# 2. the machine: GPU, driver, torch / CUDA, package versions, fp32 matmul settings
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: ${KIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "kernel: $(uname -srm)"
  echo "cpus: $(nproc)"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    nvidia-smi
  else
    echo "nvidia-smi: not found"
  fi
} > "$OUT/env.txt" 2>&1
step env "$T_ENV" "$OUT/env.txt" "$PY" - <<'PY'
import importlib.metadata as md
import platform

import torch

print("python:", platform.python_version())
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "cudnn:", torch.backends.cudnn.version())
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor}")
print("fp32 matmul: allow_tf32", torch.backends.cuda.matmul.allow_tf32, "precision", torch.get_float32_matmul_precision())
print("torch threads:", torch.get_num_threads())
for name in ("transformers", "peft", "accelerate", "safetensors", "tokenizers", "datasets", "pyarrow", "pydantic",
             "omegaconf", "triton", "liger-kernel", "trl", "numpy", "pytest"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
import importlib.util  # noqa: E402

for mod in ("pydantic", "datasets", "omegaconf", "liger_kernel"):  # the carried ones: from the install folder
    spec = importlib.util.find_spec(mod)
    print(f"{mod} from:", spec.origin if spec else "not found")
import nxd_finetune.cli  # noqa: E402,F401  the CLI's imports resolve with the carried wheels

print("nxd_finetune:", nxd_finetune.cli.__name__, "imports")
PY

# 3. the cuda-marked tests: this kit's and the FlexAttention path's (NXD_TEST_DEVICE=cpu in a dry run: the same checks on the CPU, tiny shapes)
export NXD_TEST_DEVICE=$DEVICE
read -r -a TESTS <<< "${KIT_TESTS:-tests/test_cuda.py tests/test_flex_attention.py}"
step test "$T_TEST" "$OUT/test_cuda.log" "$PY" -m pytest -v -p no:cacheprovider -m cuda "${TESTS[@]}" \
  --junitxml "$OUT/test_cuda.xml" --durations=0

# 4. the GPU bench (written separately; skipped, and said, where this tree has none)
if [ "$T_BENCH" -le 10 ]; then
  echo "bench: skipped: KIT_T_BENCH=$T_BENCH (a tests-only rerun)" >> "$STEPS"
elif [ -f bench/bench_gpu.py ]; then
  # its own budget a little inside the time box: it skips what would start late and writes what it has
  step bench "$T_BENCH" "$OUT/bench.log" "$PY" bench/bench_gpu.py --out "$OUT" --budget-s "$((T_BENCH - 10))" \
    "${BENCH_ARGS[@]}"
else
  echo "bench: skipped: bench/bench_gpu.py is not in this tree" >> "$STEPS"
fi

printf '%-8s %7s s\n' total "$(since "$T0")" >> "$STEPS"
cat "$STEPS"
exit "$FAILED"

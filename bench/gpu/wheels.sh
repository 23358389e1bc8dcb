#!/usr/bin/env bash
# Download the Python wheels the GPU machine lacks into .whl/ (docs/gpu.md), for the machine's
# Python (cp312, manylinux x86_64). The GPU machine has no network: `bench/gpu/run.sh` installs
# these with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
#
#   bash bench/gpu/wheels.sh                     # .whl/ for the GPU machine (Python 3.12)
#   WHEEL_DIR=/tmp/w PYVER=3.11 bash bench/gpu/wheels.sh   # the same set for another Python (CPU dry run)
#
# Env: WHEEL_DIR (.whl), PYVER (3.12), PY (python3: runs the check, needs `packaging`), PIP ($PY -m pip;
# any pip downloads for another Python).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEEL_DIR=${WHEEL_DIR:-.whl}
PYVER=${PYVER:-3.12}
PY=${PY:-python3}
PIP=${PIP:-$PY -m pip}

# What the GPU image lacks that nxd-finetune or the GPU bench imports; versions as tested here.
# The image already holds torch, triton, transformers, peft, accelerate, safetensors, tokenizers,
# huggingface-hub, numpy, pandas, pyarrow, fsspec, xxhash, requests, tqdm, filelock, packaging,
# pyyaml, jinja2, typer, rich, typing-extensions, aiohttp, httpx, pytest.
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5  # recipes
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                                      # data cache
  omegaconf==2.4.0                                                                        # nxdt-config
  liger-kernel==0.8.5                                                                     # bench: HF + Liger
)
# Names the image has (checked against each wheel's Requires-Dist below).
IMAGE_HAS="torch triton transformers peft accelerate safetensors tokenizers huggingface-hub numpy pandas pyarrow
fsspec xxhash requests tqdm filelock packaging pyyaml jinja2 typer rich typing-extensions aiohttp httpx pytest
click shellingham markdown-it-py pygments regex psutil"

mkdir -p "$WHEEL_DIR"
if [ -d .git ] && ! grep -qxF "/$WHEEL_DIR/" .git/info/exclude 2>/dev/null && [[ "$WHEEL_DIR" != /* ]]; then
  mkdir -p .git/info && echo "/$WHEEL_DIR/" >> .git/info/exclude
fi
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
$PIP download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" \
  -d "$WHEEL_DIR" "${WHEELS[@]}"

# one version of each (two stop the whole install), and every requirement met by the set or the image
"$PY" - "$WHEEL_DIR" "$PYVER" "$IMAGE_HAS" "${WHEELS[@]}" <<'PY'
import re, sys, zipfile
from pathlib import Path
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

wheel_dir, pyver, image, wanted = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4:]
names = {canonicalize_name(w.split("==")[0]): w.split("==")[1] for w in wanted}
have: dict[str, list[str]] = {}
for whl in sorted(wheel_dir.glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(whl.name)
    if name not in names:
        sys.exit(f"error: {whl.name} is not in the wanted set: remove it")
    have.setdefault(name, []).append(str(version))
for name, versions in have.items():
    if versions != [names[name]]:
        sys.exit(f"error: {name}: {versions} in {wheel_dir}, want only {names[name]}")
if missing := sorted(set(names) - set(have)):
    sys.exit(f"error: not downloaded: {missing}")
env = {"python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
known = set(have) | {canonicalize_name(n) for n in image}
for whl in sorted(wheel_dir.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if canonicalize_name(req.name) not in known:
            sys.exit(f"error: {whl.name} needs {line}: neither in the image nor in {wheel_dir}")
total = sum(p.stat().st_size for p in wheel_dir.glob("*.whl"))
print(f"{len(have)} wheels for cp{pyver.replace('.', '')} in {wheel_dir}: {total / 2**20:.1f} MiB")
PY

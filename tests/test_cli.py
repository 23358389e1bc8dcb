"""The CLI: light import, one-line errors with exit code 2, ``validate`` on the shipped recipes
against tiny stand-in checkpoints of the same architectures, ``run`` delegating to the trainer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nxd_finetune.cli import main
from nxd_finetune.preflight import estimate_memory
from tests.model_helpers import num_parameters

REPO = Path(__file__).resolve().parents[1]

# same architecture, head and kv-head counts as the real models; tiny widths; layers enough for pp
STANDINS = {
    "llama3-8b-lora": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                       "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "vocab_size": 1024, "rope_theta": 500000.0},
    "mistral-7b-sft": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 256,
                       "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "vocab_size": 1024},
    "qwen2-7b-lora": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 224,
                      "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 28,
                      "num_key_value_heads": 4, "vocab_size": 1024},
}
ROWS = {
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "alpaca": {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
    "qa": {"question": "2+3?", "answer": "5"},
}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return info.value.code or 0, out.out, out.err


def write_standin(path: Path, hf_config: dict) -> Path:
    """An HF directory: config.json, zero bf16 weights of the right shapes, the quickstart's
    tokenizer (``validate`` tokenizes the data to count each micro-batch's targets)."""
    from nxd_finetune.models import DecoderConfig, build_model, save_pretrained
    from nxd_finetune.quickstart import ensure_tiny_model

    config = DecoderConfig.from_hf(hf_config)
    shapes = build_model(config).state_dict()
    save_pretrained(config, ((n, torch.zeros(t.shape, dtype=torch.bfloat16)) for n, t in shapes.items()), path)
    (path / "config.json").write_text(json.dumps(hf_config))
    for f in ensure_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory, quickstart_cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("assets")
    models = {name: write_standin(root / name, cfg) for name, cfg in STANDINS.items()}
    for name in ("messages", "alpaca"):
        (root / f"{name}.jsonl").write_text("\n".join(json.dumps(ROWS[name]) for _ in range(3)) + "\n")
    pq.write_table(pa.Table.from_pylist([ROWS["qa"]] * 3), root / "qa.parquet")
    data = {
        "llama3-8b-lora": [f"data.train={root}/messages.jsonl", f"data.eval={root}/messages.jsonl"],
        "mistral-7b-sft": [f"data.train={root}/alpaca.jsonl"],
        "qwen2-7b-lora": [f"data.train=[{root}/qa.parquet, {root}/qa.parquet]", f"data.eval={root}/qa.parquet"],
    }
    return SimpleNamespace(root=root, models=models, data=data)


def validate_args(assets, name: str, *extra: str) -> list[str]:
    return ["validate", REPO / "recipes" / f"{name}.yaml", f"model.path={assets.models[name]}",
            *assets.data[name], *extra]


# what the CLI's import and its help pages leave out (the commands import them), with every module under
# each: training, the recipe, the registry and storage packages, the S3 client (typer itself imports pydantic
# to build a command's help). The registry package's own __init__ (lazy) and its CLI sub-app are allowed.
HEAVY = ("torch", "transformers", "numpy", "safetensors", "datasets", "boto3", "botocore", "yaml",
         "nxd_finetune.recipe", "nxd_finetune.registry", "nxd_finetune.storage", "nxd_finetune.sft",
         "nxd_finetune.serve.generate", "nxd_finetune.cluster.k8s", "nxd_finetune.nxdt.convert")
LIGHT = ("nxd_finetune.registry", "nxd_finetune.registry.cli")


@pytest.mark.parametrize("argv", [[], ["--help"], ["run", "--help"], ["adapters", "--help"], ["generate", "--help"],
                                  ["k8s", "--help"], ["import", "--help"]])
def test_import_and_help_are_light(argv):
    code = ("import io, sys, contextlib, nxd_finetune.cli as cli\n"
            f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): cli.main({argv!r})\n"
            f"print(sorted(m for m in sys.modules if m not in {LIGHT!r} and "
            f"any(m == h or m.startswith(h + '.') for h in {HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stderr


def test_training_imports_no_pipeline_runtime():
    """What a one-process ``run`` imports leaves out ``torch.distributed.pipelining`` (and the
    DTensor stack it pulls in, ~1-2 s of every run's start): the pipeline runner imports it when a
    pp > 1 layout first runs (issue 46 item 5)."""
    code = ("import sys, nxd_finetune.sft.trainer, nxd_finetune.sft.setup, nxd_finetune.parallel.parallelize\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.pipelining')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_tokenizer_and_model_build_stay_light(quickstart_cache):
    """Loading a local model's tokenizer and building the model on the meta device import neither
    the model family's transformers config module (it pulls the DTensor stack, sympy and accelerate)
    nor ``torch._dynamo`` (meta ``normal_``; a training run's optimizer still imports it, ``generate``
    need not): ~60 and ~70 MB resident; the tokenizer is the one ``AutoTokenizer`` loads by itself
    (issue 44 item 9)."""
    code = ("import sys, torch\n"
            "from types import SimpleNamespace\n"
            "from transformers import AutoTokenizer\n"
            "from nxd_finetune.data.inputs import load_tokenizer, resolve_model_dir\n"
            "from nxd_finetune.models.config import DecoderConfig\n"
            "from nxd_finetune.models.loading import build_model\n"
            "d = resolve_model_dir('builtin:tiny-llama')\n"
            "tok = load_tokenizer(SimpleNamespace(model=SimpleNamespace(tokenizer=None, revision=None)), d)\n"
            "build_model(DecoderConfig.from_hf(d))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('accelerate', 'sympy') or "
            "m.startswith(('torch._dynamo', 'torch.distributed.tensor', 'transformers.models.llama'))))\n"
            "ref = AutoTokenizer.from_pretrained(d)\n"
            "chat = [{'role': 'user', 'content': 'What is 2 + 2?'}]\n"
            "same = (type(tok) is type(ref) and tok('a b c').input_ids == ref('a b c').input_ids and "
            "tok.apply_chat_template(chat, add_generation_prompt=True) == "
            "ref.apply_chat_template(chat, add_generation_prompt=True) and tok.eos_token_id == ref.eos_token_id "
            "and tok.pad_token_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id))\n"
            "print(same)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NXD_FINETUNE_CACHE": str(quickstart_cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout[:1000] + out.stderr[-2000:]


def test_run_help_says_what_run_trains(capsys):
    code, out, _ = cli(capsys, "run", "--help")
    words = set(re.findall(r"[\w-]+", out))
    assert code == 0 and "SFT loop" not in " ".join(out.split())
    assert {"SFT", "DPO", "ORPO", "LoRA", "full", "--nproc", "resumes"} <= words, out


def test_bad_recipe_subprocess_exit_2_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: /m}\ndata: {train: /t.jsonl}\nlora: {rnak: 8}\n")
    proc = subprocess.run([sys.executable, "-m", "nxd_finetune", "validate", str(bad)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "unknown key 'lora.rnak' (did you mean 'lora.rank'?)" in lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["validate", "missing.yaml"], "error: recipe file not found: missing.yaml"),
    (["run", "RECIPE", "lora.rank"], "error: override 'lora.rank' has no '='"),
    (["run", "RECIPE", "--resume", "latest", "--no-resume"], "error: --resume and --no-resume are mutually"),
    (["validate", "RECIPE", "parallel.tp=2"], "error: override 'parallel.tp=2': parallel.nproc=1 is not "
                                              "divisible by tp*pp=2*1=2"),
])
def test_cli_errors(capsys, tmp_path, args, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: /m}\ndata: {train: /t.jsonl}\n")
    code, out, err = cli(capsys, *[recipe if a == "RECIPE" else a for a in args])
    assert code == 2
    assert err.startswith(expected) and err.count("\n") == 1


def test_run_delegates_to_the_trainer(capsys, monkeypatch, tmp_path):
    from nxd_finetune.sft import trainer

    seen = []
    monkeypatch.setattr(trainer, "run", seen.append)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {path: builtin:tiny-llama}\ndata: {train: t.jsonl}\ncheckpoint: {resume: latest}\n")
    assert cli(capsys, "run", recipe, "lora.rank=4", "--nproc", "2", "--resume", "ck/step-5")[0] == 0
    assert cli(capsys, "run", recipe, "--no-resume")[0] == 0
    first, second = seen
    assert first.parallel.nproc == 2 and first.lora.rank == 4
    assert first.checkpoint.resume == "ck/step-5"
    assert first.data.train == str(tmp_path / "t.jsonl")
    assert second.checkpoint.resume is None and second.parallel.nproc == 1


LORA_TRAINABLE = {
    # rank * (in + out) summed over the targets of one layer, times 2 layers (hand-computed)
    "llama3-8b-lora": 2 * 16 * ((256 + 256) * 2 + (256 + 64) * 2 + (256 + 512) * 3),  # q,o k,v gate,up,down
    "qwen2-7b-lora": 2 * 64 * ((224 + 224) * 2 + (224 + 32) * 2 + (224 + 512) * 3),  # all-linear
}


@pytest.mark.parametrize("name", list(STANDINS))
def test_validate_shipped_recipes(capsys, assets, name):
    from nxd_finetune.models import DecoderConfig

    code, out, err = cli(capsys, *validate_args(assets, name))
    assert code == 0, err
    assert "recipe is valid" in out and "Traceback" not in err
    assert f"path: {assets.models[name]}" in out  # the resolved recipe is printed
    total, trainable = (int(x.replace(",", "")) for x in
                        re.search(r"parameters: total ([\d,]+)\s+trainable ([\d,]+)", out).groups())
    assert total == num_parameters(DecoderConfig.from_hf(STANDINS[name])) + LORA_TRAINABLE.get(name, 0)
    assert trainable == LORA_TRAINABLE.get(name, total)
    for row in ("weights", "gradients", "optimizer", "activations", "total"):
        assert re.search(rf"{row}\s+.*\d+\.\d+ (KiB|MiB|GiB)", out), row
    assert "MALLOC_MMAP_THRESHOLD_" in out  # CPU training: the heap's growth and what lowers it


@pytest.mark.parametrize(("name", "extra", "expected"), [
    ("llama3-8b-lora", ["parallel.nproc=6", "parallel.tp=3", "parallel.sequence_parallel=false"],
     "error: parallel.tp=3 does not divide the model's num_attention_heads=32"),
    ("qwen2-7b-lora", ["parallel.nproc=8", "parallel.tp=8"],
     "error: parallel.tp=8 does not divide the model's num_attention_heads=28"),
    ("mistral-7b-sft", ["parallel.virtual_stages=3"],
     "error: the model's num_hidden_layers=4 is not divisible by pp*virtual_stages=2*3=6"),
    ("llama3-8b-lora", ["lora.target_modules=[qkv_proj]"], "['qkv_proj'] matched no module"),
    ("qwen2-7b-lora", ["data.fields={}"], "format 'prompt_completion' needs column(s) 'prompt', 'completion'"),
    ("mistral-7b-sft", ["data.train=/nonexistent/train.jsonl"], "error: data.train: not found: /nonexistent"),
    ("mistral-7b-sft", ["model.path=/nonexistent/model"], "/nonexistent/model"),
])
def test_validate_failures(capsys, assets, name, extra, expected):
    code, out, err = cli(capsys, *validate_args(assets, name), *extra)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert expected in err, err


def test_validate_unreadable_data(capsys, assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS["messages"]) + "\n{oops\n")
    code, _, err = cli(capsys, *validate_args(assets, "llama3-8b-lora"), f"data.eval={bad}")
    assert code == 2 and f"{bad}:2: invalid JSON" in err
    garbage = tmp_path / "qa.parquet"
    garbage.write_text("not parquet")
    code, _, err = cli(capsys, *validate_args(assets, "qwen2-7b-lora"), f"data.eval={garbage}")
    assert code == 2 and f"error: data.eval: cannot read {garbage}: " in err and err.count("\n") == 1


def test_validate_checks_checkpoint_tensors(capsys, assets, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in assets.models["llama3-8b-lora"].iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**STANDINS["llama3-8b-lora"], "num_hidden_layers": 4}))
    code, _, err = cli(capsys, *validate_args(assets, "llama3-8b-lora"), f"model.path={model}")
    assert code == 2 and "lacks model.layers.2." in err
    (model / "config.json").write_text(json.dumps({**STANDINS["llama3-8b-lora"], "intermediate_size": 1024}))
    code, _, err = cli(capsys, *validate_args(assets, "llama3-8b-lora"), f"model.path={model}")
    assert code == 2 and "has shape [512, 256], the config implies [1024, 256]" in err


def test_validate_json(capsys, assets):
    """``validate --json``: stdout is one JSON document holding the resolved layout and the memory
    estimate's parts and total per rank, the same numbers as the text report."""
    from nxd_finetune.models import DecoderConfig
    from nxd_finetune.recipe import load_recipe

    name = "llama3-8b-lora"
    layout_args = ["parallel.nproc=8", "parallel.tp=2", "parallel.pp=2", "parallel.zero1=true",
                   "training.global_batch_size=16"]
    code, out, err = cli(capsys, *validate_args(assets, name, *layout_args), "--json")
    assert code == 0, err
    doc = json.loads(out)  # the whole of stdout: no YAML, no table
    lay = doc["layout"]
    assert (lay["nproc"], lay["tp"], lay["pp"], lay["dp"], lay["zero1"]) == (8, 2, 2, 2, True)
    assert lay["global_batch_size"] == 16 and lay["grad_accum"] == 16 // (lay["micro_batch_size"] * 2)
    total, trainable = doc["parameters"]["total"], doc["parameters"]["trainable"]
    config = DecoderConfig.from_hf(STANDINS[name])
    assert total == num_parameters(config) + LORA_TRAINABLE[name] and trainable == LORA_TRAINABLE[name]
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", [f"model.path={assets.models[name]}",
                                                              *assets.data[name], *layout_args])
    targets = doc["max_targets_per_micro_batch"]  # counted in the tokenized data
    assert isinstance(targets, int) and targets > 0
    want = estimate_memory(recipe, config, total, trainable, targets)
    mem = doc["memory_per_rank_bytes"]
    assert set(mem) == {"runtime", "weights", "gradients", "optimizer", "activations", "loss", "vocabulary gradient",
                        "allocator cache", "optimizer step", "checkpoint save", "total"}
    assert all(mem[k] == round(v) for k, v in want.items())
    assert mem["total"] == round(sum(want.values()))

    code, text, err = cli(capsys, *validate_args(assets, name, *layout_args))
    assert code == 0, err
    from nxd_finetune.preflight import human_bytes

    assert re.search(rf"total\s+.*{re.escape(human_bytes(sum(want.values())))}", text)

    code, out, err = cli(capsys, *validate_args(assets, name, "parallel.nproc=6", "parallel.tp=3",
                                                 "parallel.sequence_parallel=false"), "--json")
    assert code == 2 and out == "" and err.startswith("error: parallel.tp=3 does not divide")


def test_bf16_on_a_cpu_without_bf16_instructions_is_one_warning_line(capsys, assets):
    """``validate`` (and ``run``, through the same check) warns in one line exactly when the recipe
    computes in bf16 on a CPU whose oneDNN reports no native bf16; an fp32 recipe never warns."""
    import warnings

    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    for extra, expect in ((["training.device=cpu"], not native),
                          (["training.device=cpu", "training.precision=fp32", "model.dtype=fp32"], False)):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            code, _, err = cli(capsys, *validate_args(assets, "llama3-8b-lora", *extra))
        assert code == 0, err
        lines = [ln for ln in err.splitlines() if "matrix instructions" in ln]
        cap = torch.backends.cpu.get_cpu_capability()
        want = [f"warning: this CPU ({cap}) has no native bf16 matrix instructions: bf16 matmuls take a fallback "
                "path that can be 100x slower than fp32; for a CPU run here set training.precision=fp32 "
                "model.dtype=fp32"]
        assert lines == (want if expect else []), (extra, err)

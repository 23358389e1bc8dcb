"""A corpus of bad inputs: each ends in exactly one ``error:`` line naming the culprit, the exit
code 2, no traceback, and nothing written where the command would have written.

The CLI runs in-process (``nxd_finetune.cli.main``) for speed; every case gets a fresh directory.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import yaml

from nxd_finetune.cli import main
from nxd_finetune.data.inputs import resolve_model_dir
from tests.adapter_helpers import small_adapter

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
DPO = [ROOT / "recipes" / "quickstart-dpo.yaml", "lora.init_from=null"]  # its adapter is the SFT quickstart's
SHORT = ["training.max_steps=1", "logging.progress=false", "eval.before=false"]


def _recipe(tmp: Path, text: str) -> Path:
    path = tmp / "r.yaml"
    path.write_text(text)
    return path


def _rows(tmp: Path, name: str, rows: list) -> Path:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _quickstart_with(tmp: Path, **sections) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    # the quickstart's relative data paths: absolute, since the recipe now lives in tmp
    for split in ("train", "eval"):
        value = data["data"].get(split)
        if isinstance(value, str) and not Path(value).is_absolute():
            data["data"][split] = str(QUICKSTART.resolve().parent / value)
    if data["data"].get("eval") is None:
        data["eval"] = {**(data.get("eval") or {}), "every_n_steps": None}
    return _recipe(tmp, yaml.safe_dump(data))


# name -> fn(tmp) -> (argv, substring of the one error line)
CASES = {
    # ---- recipe files and overrides
    "recipe missing": lambda t: (["run", t / "nope.yaml"], "nope.yaml"),
    "recipe is a list": lambda t: (["run", _recipe(t, "- a\n- b\n")], "r.yaml"),
    "recipe empty": lambda t: (["run", _recipe(t, "")], "r.yaml"),
    "recipe binary": lambda t: (["run", _recipe(t, "\x00\x01\x02garbage: [")], "r.yaml"),
    "yaml syntax": lambda t: (["validate", _recipe(t, "model: {path: x\n")], "r.yaml"),
    "unknown section": lambda t: (["validate", QUICKSTART, "modle.path=x"], "modle"),
    "unknown nested key": lambda t: (["validate", QUICKSTART, "training.learning_rat=0.1"], "learning_rat"),
    "override without =": lambda t: (["validate", QUICKSTART, "training.lr"], "training.lr"),
    "max_steps not a number": lambda t: (["run", QUICKSTART, "training.max_steps=abc"], "training.max_steps"),
    "negative rank": lambda t: (["validate", QUICKSTART, "lora.rank=-4"], "lora.rank"),
    "zero alpha": lambda t: (["validate", QUICKSTART, "lora.alpha=0"], "lora.alpha"),
    "lr zero": lambda t: (["validate", QUICKSTART, "training.lr=0"], "training.lr"),
    "bad precision": lambda t: (["validate", QUICKSTART, "training.precision=fp8"], "training.precision"),
    "bad scheduler": lambda t: (["validate", QUICKSTART, "training.scheduler=cyclic"], "training.scheduler"),
    "bad save mode": lambda t: (["validate", QUICKSTART, "checkpoint.save_mode=zip"], "checkpoint.save_mode"),
    "bad data format": lambda t: (["validate", QUICKSTART, "data.format=xml"], "data.format"),
    "chat_template_kwargs value a list": lambda t: (
        ["validate", QUICKSTART, "data.chat_template_kwargs.enable_thinking=[1]"],
        "data.chat_template_kwargs.enable_thinking must be a string, number, true/false or null"),
    "chat_template_kwargs not a mapping": lambda t: (
        ["validate", QUICKSTART, "data.chat_template_kwargs=false"], "data.chat_template_kwargs must be a mapping"),
    "chat_template_kwargs an argument": lambda t: (
        ["validate", QUICKSTART, "data.chat_template_kwargs.tokenize=false"], "data.chat_template_kwargs.tokenize"),
    "generate --chat-template-kwargs not JSON": lambda t: (
        ["generate", "--base", "builtin:tiny-llama", "--prompt", "hi", "--chat-template-kwargs", "{thinking: no}"],
        "--chat-template-kwargs is not JSON"),
    "chat --chat-template-kwargs a list": lambda t: (
        ["chat", "--base", "builtin:tiny-llama", "--chat-template-kwargs", "[1]"],
        "--chat-template-kwargs must be a mapping"),
    "max_seq_len 1": lambda t: (["validate", QUICKSTART, "data.max_seq_len=1"], "data.max_seq_len"),
    "steps and epochs": lambda t: (["validate", QUICKSTART, "training.max_steps=5", "training.epochs=2"],
                                   "training.epochs"),
    "nproc not divisible": lambda t: (["validate", QUICKSTART, "parallel.nproc=3", "parallel.tp=2"],
                                      "not divisible by tp*pp"),
    "tp does not divide heads": lambda t: (["validate", QUICKSTART, "parallel.nproc=3", "parallel.tp=3"], "tp"),
    "sequence parallel without tp": lambda t: (["validate", QUICKSTART, "parallel.sequence_parallel=true"],
                                               "sequence_parallel"),
    "yaml alias bomb": lambda t: (["validate", _recipe(t, _alias_bomb("  lr: "))], "nested aliases"),
    "yaml alias bomb in an override": lambda t: (["validate", QUICKSTART, _alias_bomb("training.lr=")],
                                                 "nested aliases"),
    "yaml nested 50000 deep": lambda t: (["validate", _recipe(t, "model:\n  path: " + "[" * 50000 + "]" * 50000)],
                                         "nested deeper than"),
    "lr infinite": lambda t: (["validate", QUICKSTART, "training.lr=.inf"], "training.lr must be a finite number"),
    "lr nan": lambda t: (["validate", QUICKSTART, "training.lr=.nan"], "training.lr must be a finite number"),
    "alpha infinite": lambda t: (["validate", QUICKSTART, "lora.alpha=.inf"], "lora.alpha must be a finite number"),
    "epochs infinite": lambda t: (["validate", QUICKSTART, "training.max_steps=null", "training.epochs=.inf"],
                                  "training.epochs must be a finite number"),
    "beta nan": lambda t: (["validate", QUICKSTART, "training.betas=[0.9, .nan]"], "training.betas[1]"),
    "resume and no-resume": lambda t: (["run", QUICKSTART, "--resume", "x", "--no-resume"], "--no-resume"),
    "bad checkpoint module": lambda t: (["run", QUICKSTART, *SHORT, f"output.dir={t / 'out'}",
                                         "parallel.activation_checkpointing=selective",
                                         "parallel.checkpoint_modules=[Attn]"], "Attn"),
    # ---- model files
    "model dir missing": lambda t: (["validate", QUICKSTART, f"model.path={t / 'nomodel'}"], "nomodel"),
    "unknown builtin": lambda t: (["validate", QUICKSTART, "model.path=builtin:huge-llama"], "builtin:huge-llama"),
    "unsupported architecture": lambda t: (
        ["validate", QUICKSTART, f"model.path={_model_dir(t, {'architectures': ['GPT2LMHeadModel']})}"],
        "GPT2LMHeadModel"),
    "config not json": lambda t: (["validate", QUICKSTART, f"model.path={_model_dir(t, None)}"], "config.json"),
    # ---- datasets
    "data file missing": lambda t: (["validate", _quickstart_with(t, data={"train": str(t / "nope.jsonl")})],
                                    "nope.jsonl"),
    "data columns missing": lambda t: (
        ["validate", _quickstart_with(t, data={"train": str(_rows(t, "d.jsonl", [{"text": "hi"}] * 3)),
                                               "eval": None})], "messages"),
    "data malformed line": lambda t: (
        ["run", _quickstart_with(t, data={"train": str(_bad_jsonl(t)), "eval": None}), *SHORT,
         f"output.dir={t / 'out'}"], "line 3"),
    "data unsupported type": lambda t: (
        ["validate", _quickstart_with(t, data={"train": str(_touch(t / "d.txt")), "eval": None})], "d.txt"),
    "preference chosen equals rejected": lambda t: (
        ["validate", _quickstart_with(t, objective="dpo", data={"train": str(_pairs(t, {"rejected": " a"}, at=2)),
                                                                "eval": None, "format": "preference"})], "row 3"),
    "preference empty completion past the rows validate reads": lambda t: (
        ["run", _quickstart_with(t, objective="dpo", data={"train": str(_pairs(t, {"chosen": ""}, at=7)),
                                                           "eval": None, "format": "preference"}), *SHORT,
         f"output.dir={t / 'out'}"], "data.train row 8: the chosen completion is empty"),
    # ---- preference settings that overflow the loss (NaN from the first step)
    "preference beta overflows": lambda t: (["validate", *DPO, "preference.beta=1e300"],
                                            "preference.beta=1e+300 is outside [0.0001, 10000]"),
    "preference beta tiny for ipo": lambda t: (
        ["validate", *DPO, "preference.loss_type=ipo", "preference.beta=1e-300"],
        "preference.beta=1e-300 is outside [0.0001, 10000]"),
    "preference beta zero": lambda t: (["validate", *DPO, "preference.beta=0"], "preference.beta=0"),
    "orpo beta overflows": lambda t: (["validate", *DPO, "objective=orpo", "preference.beta=1e39"],
                                      "preference.beta=1e+39 is outside"),
    "simpo gamma overflows": lambda t: (
        ["validate", *DPO, "preference.loss_type=simpo", "preference.simpo_gamma=1e300"],
        "preference.simpo_gamma=1e+300 is outside [0, 10000]"),
    "eval without data": lambda t: (["validate", QUICKSTART, "data.eval=null", "data.eval_fraction=0.0",
                                     "eval.every_n_steps=5"], "eval.every_n_steps"),
    # ---- adapters and merge
    "merge missing adapter": lambda t: (["merge", "--adapter", t / "noadapter", "--base", "builtin:tiny-llama",
                                         "--out", t / "merged"], "noadapter"),
    "merge pickle adapter": lambda t: (["merge", "--adapter", _pickle_adapter(t), "--base", "builtin:tiny-llama",
                                        "--out", t / "merged"], "adapter"),
    "merge bad dtype": lambda t: (["merge", "--adapter", t, "--base", "builtin:tiny-llama", "--out", t / "m",
                                   "--dtype", "fp8"], "fp8"),
    "init_from missing": lambda t: (["run", QUICKSTART, *SHORT, f"output.dir={t / 'out'}",
                                     f"lora.init_from={t / 'gone'}"], "gone"),
    # ---- generate / chat refuse what merge, validate and lora.init_from refuse (the same checks)
    "generate adapter header of 2^62 bytes": lambda t: (
        ["generate", "--adapter", _bad_adapter(t, header_len=2**62), "--prompt", "hi"], "adapter_model.safetensors"),
    "generate adapter tensor of 2^62 bytes": lambda t: (
        ["generate", "--adapter", _bad_adapter(t, tensors=_huge), "--prompt", "hi"], "adapter_model.safetensors"),
    "generate adapter overlapping tensors": lambda t: (
        ["generate", "--adapter", _bad_adapter(t, tensors=_overlap), "--prompt", "hi"], "adapter_model.safetensors"),
    "chat adapter overlapping tensors": lambda t: (
        ["chat", "--adapter", _bad_adapter(t, tensors=_overlap)], "adapter_model.safetensors"),
    "merge adapter overlapping tensors": lambda t: (
        ["merge", "--adapter", _bad_adapter(t, tensors=_overlap), "--base", "builtin:tiny-llama", "--out", t / "m"],
        "adapter_model.safetensors"),
    "generate adapter config wrong types": lambda t: (
        ["generate", "--adapter", _bad_adapter(t, config={"r": "sixteen"}), "--prompt", "hi"], "adapter_config.json"),
    "generate adapter modules_to_save a number": lambda t: (
        ["generate", "--adapter", _bad_adapter(t, config={"modules_to_save": 5}), "--prompt", "hi"],
        "modules_to_save"),
    "merge adapter modules_to_save a number": lambda t: (
        ["merge", "--adapter", _bad_adapter(t, config={"modules_to_save": 5}), "--base", "builtin:tiny-llama",
         "--out", t / "m"], "modules_to_save"),
    "generate adapter config is a list": lambda t: (
        ["generate", "--adapter", _bad_adapter(t, config=[]), "--prompt", "hi"], "adapter_config.json"),
    "chat adapter config is a list": lambda t: (["chat", "--adapter", _bad_adapter(t, config=[])],
                                                "adapter_config.json"),
    "generate base overlapping tensors": lambda t: (
        ["generate", "--adapter", _bad_adapter(t), "--base", _bad_base(t, _overlap), "--prompt", "hi"],
        "model.safetensors"),
    "chat base overlapping tensors": lambda t: (["chat", "--base", _bad_base(t, _overlap)], "model.safetensors"),
    "generate base tensor of 2^62 bytes": lambda t: (["generate", "--base", _bad_base(t, _huge), "--prompt", "hi"],
                                                     "model.safetensors"),
    "generate generation_config eos not a token id": lambda t: (
        ["generate", "--base", _bad_generation_config(t), "--prompt", "hi"], "eos_token_id must be a token id"),
    # ---- registry refs
    "push missing dir": lambda t: (["adapters", "push", t / "nodir", f"{t}/reg/bot"], "nodir"),
    "push bad name": lambda t: (["adapters", "push", t, f"{t}/reg/Bad Name!"], "Bad Name!"),
    "push not an adapter": lambda t: (["adapters", "push", _touch(t / "a" / "x.json"), f"{t}/reg/bot"], "adapter"),
    "pull missing version": lambda t: (["adapters", "pull", f"{t}/reg/bot:7", t / "pulled"], "bot"),
    "pull bad tag syntax": lambda t: (["adapters", "pull", f"{t}/reg/bot@", t / "pulled"], "invalid tag"),
    "show unknown name": lambda t: (["adapters", "show", f"{t}/reg/nobody"], "nobody"),
    "tag missing version": lambda t: (["adapters", "tag", f"{t}/reg/bot:3", "prod"], "bot"),
}


def _alias_bomb(prefix: str) -> str:
    """A "billion laughs": nine levels of ten aliases, 10^9 values once expanded (a few hundred bytes)."""
    levels = ["x0: &x0 [a, a, a, a, a, a, a, a, a, a]"]
    levels += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, 9)]
    value = "{" + ", ".join(levels) + "}"
    return f"training:\n{prefix}{value}\n" if prefix.startswith(" ") else prefix + value


def _edit_safetensors(path: Path, edit=None, header_len: int | None = None) -> None:
    """Rewrite a safetensors file in place: ``edit(header)`` changes its JSON header (data kept);
    ``header_len`` replaces the 8-byte length prefix."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    if edit is not None:
        edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", header_len if header_len is not None else len(text)) + text + data)


def _tensors(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def _huge(header: dict) -> None:
    """The first tensor declares 2^62 bytes (a 2^31 x 2^31 shape)."""
    header[_tensors(header)[0]].update(shape=[2**31, 2**31], data_offsets=[0, 2**62])


def _overlap(header: dict) -> None:
    """The second tensor's bytes are the first one's."""
    first, second = _tensors(header)[:2]
    header[second] = dict(header[first])


def _bad_adapter(tmp: Path, tensors=None, header_len: int | None = None, config=None) -> Path:
    """A small LoRA adapter of the quickstart model, its safetensors header edited by ``tensors`` /
    ``header_len`` and its ``adapter_config.json`` updated with (or replaced by a non-dict) ``config``."""
    d = small_adapter(tmp / "adapter")
    if tensors is not None or header_len is not None:
        _edit_safetensors(d / "adapter_model.safetensors", tensors, header_len)
    if config is not None:
        old = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**old, **config} if isinstance(config, dict) else config))
    return d


def _bad_base(tmp: Path, edit) -> Path:
    """A copy of the quickstart model with its safetensors header edited by ``edit``."""
    d = tmp / "base"
    shutil.copytree(resolve_model_dir("builtin:tiny-llama"), d)
    _edit_safetensors(d / "model.safetensors", edit)
    return d


def _bad_generation_config(tmp: Path) -> Path:
    """A copy of the quickstart model whose ``generation_config.json`` names an eos that is no token id."""
    d = tmp / "base"
    shutil.copytree(resolve_model_dir("builtin:tiny-llama"), d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, "two"]}))
    return d


def _model_dir(tmp: Path, config: dict | None) -> Path:
    """A model directory with the quickstart's tokenizer and the given ``config.json``."""
    d = tmp / "model"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(resolve_model_dir("builtin:tiny-llama") / name, d / name)
    (d / "config.json").write_text("{not json" if config is None else json.dumps(config))
    return d


def _pairs(tmp: Path, bad: dict, at: int) -> Path:
    """Ten preference pairs, the one at index ``at`` changed by ``bad``."""
    rows = [{"prompt": f"Is {n} even?", "chosen": " a", "rejected": " b"} for n in range(10)]
    rows[at] |= bad
    return _rows(tmp, "pairs.jsonl", rows)


def _bad_jsonl(tmp: Path) -> Path:
    good = json.dumps({"messages": [{"role": "user", "content": "Is 2 even?"},
                                    {"role": "assistant", "content": "even"}]})
    path = tmp / "bad.jsonl"
    path.write_text(f"{good}\n{good}\n{{\"messages\": [\n{good}\n")
    return path


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    return path


def _pickle_adapter(tmp: Path) -> Path:
    d = tmp / "pickled"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                       "target_modules": ["q_proj"]}))
    (d / "adapter_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return d


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_line(name, tmp_path, capsys, quickstart_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    case = tmp_path / "case"
    case.mkdir()
    argv, culprit = CASES[name](case)
    before = {p for p in case.rglob("*")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert info.value.code == 2, (name, err)
    assert "Traceback" not in err, (name, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
    assert culprit in lines[0], (name, culprit, lines[0])
    created = {p for p in case.rglob("*")} - before
    assert not [p for p in created if p.is_file() and p.name not in ("recipe.yaml", "metrics.jsonl")], \
        (name, sorted(map(str, created)))
    assert not [p for p in created if p.name in ("final", "summary.json")], name


def test_the_corpus_has_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_a_diverging_run_stops_at_the_first_non_finite_loss(objective, tmp_path, capsys, quickstart_cache,
                                                            monkeypatch):
    """Two sane steps, then resumed with ``training.lr=1e30``: step 3 is finite, its update
    overflows the weights, step 4's loss is NaN. The run stops there in one line naming the step
    and what to change (exit 2, no traceback), before anything stores the NaN: ``metrics.jsonl``
    holds steps 1-3 (strict JSON), no checkpoint of step 4 is written, and a run resumed from
    step 2's checkpoint with a sane lr completes."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    recipe = [QUICKSTART] if objective == "sft" else DPO
    argv = ["run", *recipe, "logging.progress=false", "eval.before=false", "eval.every_n_steps=null",
            "data.eval=null", "data.max_samples=64", "training.warmup_steps=0", "logging.every_n_steps=1",
            "checkpoint.every_n_steps=1", "checkpoint.keep_last=5", f"output.dir={out}",
            f"data.cache_dir={tmp_path / 'cache'}"]

    def ok(*more: object) -> None:
        with pytest.raises(SystemExit) as done:
            main([str(a) for a in [*argv, *more]])
        assert done.value.code == 0, capsys.readouterr().err

    ok("training.max_steps=2")
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in [*argv, "training.max_steps=6", "training.lr=1e30", "--resume", "latest"]])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert info.value.code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: step 4: the training loss is nan"), err
    assert "lower training.lr (now 1e+30)" in lines[0]
    assert ("preference.beta (now 0.05)" in lines[0]) == (objective == "dpo")

    def strict(constant: str) -> float:
        raise AssertionError(f"{constant} in metrics.jsonl")

    records = [json.loads(line, parse_constant=strict) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == ["step-00000001", "step-00000002", "step-00000003"], saved
    ok("training.max_steps=6", "training.lr=1e-3", "--resume", out / "checkpoints" / "step-00000002")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000002") and summary["steps"] == 6
    assert [h["step"] for h in summary["history"]] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(h["train_loss"]) for h in summary["history"])

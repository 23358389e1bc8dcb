"""A full disk ends in one line with nothing half-written: a registry push, a pull, and a run whose
checkpoint cannot be saved, each on a 512 KiB tmpfs (skipped where this process may not mount one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nxd_finetune.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def adapter(quickstart_cache, tmp_path) -> Path:
    """A 1.2 MB adapter of the quickstart model (r16, all linear layers)."""
    from nxd_finetune.data.inputs import resolve_model_dir
    from nxd_finetune.lora import LoraConfig, inject_lora, save_adapter
    from nxd_finetune.models import load_pretrained

    model = load_pretrained(resolve_model_dir("builtin:tiny-llama"))
    cfg = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    inject_lora(model, cfg)
    return save_adapter(model, cfg, tmp_path / "adapter", base_model_name_or_path=None)


def cli(capsys, *args) -> tuple[int, list[str]]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    return info.value.code or 0, [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]


def test_push_and_pull_on_a_full_disk(full_disk, adapter, tmp_path, capsys):
    code, lines = cli(capsys, "adapters", "push", adapter, full_disk / "reg" / "bot")
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: no space left on device"), lines
    code, lines = cli(capsys, "adapters", "ls", full_disk / "reg")
    assert code == 0  # no version became visible
    assert not [p for p in (full_disk / "reg").rglob("*") if p.is_file()]  # nothing partial left

    ok = tmp_path / "reg"
    assert cli(capsys, "adapters", "push", adapter, ok / "bot")[0] == 0
    code, lines = cli(capsys, "adapters", "pull", f"{ok}/bot:1", full_disk / "pulled")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: no space left on device writing {full_disk}"), lines  # the destination
    assert [p.name for p in full_disk.iterdir()] == ["reg"]  # no pulled/ and no temp directory


def test_run_whose_checkpoint_does_not_fit(full_disk, quickstart_cache, capsys):
    out = full_disk / "run"
    code, lines = cli(capsys, "run", ROOT / "recipes" / "quickstart.yaml", f"output.dir={out}",
                      "training.max_steps=2", "checkpoint.every_n_steps=1", "logging.progress=false",
                      "eval.before=false")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: saving checkpoint step-00000001 under") and "No space left" in lines[0]
    assert not list((out / "checkpoints").iterdir())  # the failed save left no step directory
    assert not (out / "final").exists()


@pytest.mark.parametrize("save_mode", ["adapter", "merged"])
def test_run_whose_final_export_does_not_fit(full_disk, quickstart_cache, capsys, save_mode):
    """Training fits (no checkpoints; metrics are small) but the 1.2 MB adapter (or the merged
    checkpoint) does not: one line, exit 1, no final/, no partial directory, no *.tmp file."""
    out = full_disk / "run"
    code, lines = cli(capsys, "run", ROOT / "recipes" / "quickstart.yaml", f"output.dir={out}",
                      "training.max_steps=1", "training.warmup_steps=0", "logging.progress=false",
                      "eval.before=false", "eval.every_n_steps=null", "data.eval=null",
                      f"checkpoint.save_mode={save_mode}", f"checkpoint.dir={full_disk.parent / 'ckpt'}")
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: no space left on device writing {out}/"), lines
    assert (out / "metrics.jsonl").is_file() and not (out / "final").exists()  # trained, then the export failed
    left = [p.name for p in out.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]
    assert not left, left  # no .final.partial-*, .nxd-adapter-* or *.tmp


def test_adapter_files_written_in_place_leave_no_tmp(full_disk, adapter):
    """``write_adapter_files`` straight into a directory (the API's ``save_adapter``): a full disk
    raises ENOSPC naming the file and leaves no ``*.tmp`` behind."""
    import errno

    from nxd_finetune.lora import read_adapter, write_adapter_files

    cfg, tensors = read_adapter(adapter)
    with pytest.raises(OSError) as info:
        write_adapter_files(full_disk / "direct", cfg, {f"base_model.model.{k}": t for k, t in tensors.items()},
                            [], None)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(full_disk / "direct" /
                                                                          "adapter_model.safetensors")
    assert not list((full_disk / "direct").iterdir())

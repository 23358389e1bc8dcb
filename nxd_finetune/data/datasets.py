"""Load dataset rows, tokenize them once, and cache the result on disk.

Flow: :func:`load_rows` (``datasets``) -> ``tokenize.tokenize_rows`` (formats.py: render, tokenize,
mask; truncate to ``max_seq_len``; drop samples left with nothing to train; ``data.num_proc``
worker processes) -> :class:`TokenizedDataset`
(flat int32 tensors + offsets) -> cached as safetensors by :func:`prepare_datasets`.

The cache key hashes the tokenizer (``backend_tokenizer.to_str()``, special tokens, chat template),
the data settings that change tokens (paths, format, fields, chat template and, when set, its
chat_template_kwargs, max_seq_len, train_on_prompt, eval_fraction, max_samples; for ``preference``
also max_prompt_length, truncation_mode and, unless DPOTrainer's, the TRL trainer whose tokenization
the pairs follow) and each data file's path, size and mtime (``save_to_disk``
directories: every file in them). ``packing`` and ``shuffle`` act later, on the cached samples, so
changing them reuses the cache. Entries are written to a temporary directory and renamed into place:
several ranks may call :func:`prepare_datasets` at once safely (have local rank 0 go first and the
others wait at a barrier to avoid duplicate work).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_finetune.data import formats
from nxd_finetune.data.preference import TRL_TOKENIZATIONS, TRUNCATION_MODES
from nxd_finetune.data.tokenize import TokenizedDataset, tokenize_rows
from nxd_finetune.errors import DataError
from nxd_finetune.objectives import objective_record, section_of
from nxd_finetune.storage.atomic import publish_dir
from nxd_finetune.storage.cache import data_cache
from nxd_finetune.storage.fetch import fetch_object
from nxd_finetune.storage.schemes import data_forms, data_scheme

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import DataSection, Recipe

CACHE_VERSION = 1
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
EVAL_SPLIT_SEED = 0  # eval_fraction split: fixed, so train/eval never mix across runs or seeds


@dataclasses.dataclass
class DataSpec:
    """The recipe's ``data`` section, with the same attribute names and defaults."""

    train: str | list[str] | None = None
    eval: str | list[str] | None = None
    eval_fraction: float = 0.0
    format: str = "messages"
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, formats.TemplateValue] | None = None  # {} is None: the same renders
    max_seq_len: int = 2048
    packing: bool = True
    train_on_prompt: bool = False
    cache_dir: str | None = None
    shuffle: bool = True
    max_samples: int | None = None
    num_proc: int | str = "auto"
    # format preference (TRL's names; the recipe's ``preference`` section sets them, see from_recipe)
    max_prompt_length: int | None = None
    truncation_mode: str = "keep_start"
    trl_tokenization: str = "dpo"  # whose pairs: TRL's DPOTrainer, or ORPOTrainer / CPOTrainer ("orpo")

    @classmethod
    def of(cls, section: DataSpec | DataSection | Mapping[str, object]) -> DataSpec:
        """From a DataSpec, a mapping, or any object with these attributes (the pydantic section)."""
        if isinstance(section, cls):
            return section
        names = [f.name for f in dataclasses.fields(cls)]
        if isinstance(section, Mapping):
            unknown = sorted(set(section) - set(names))
            if unknown:
                raise DataError(f"unknown data setting(s): {', '.join(unknown)}")
            values: dict[str, Any] = dict(section)  # checked by the dataclass's fields below
        else:
            values = {n: getattr(section, n) for n in names if hasattr(section, n)}
        spec = cls(**values)
        spec.fields = dict(spec.fields or {})
        problem = formats.template_kwargs_problem(spec.chat_template_kwargs)
        if problem:
            raise DataError(problem)
        spec.chat_template_kwargs = dict(spec.chat_template_kwargs or {}) or None
        if spec.format not in formats.FORMATS:
            raise DataError(f"unknown data.format {spec.format!r}; use one of {', '.join(formats.FORMATS)}")
        if spec.max_seq_len < 2:
            raise DataError(f"data.max_seq_len must be at least 2, got {spec.max_seq_len}")
        if spec.truncation_mode not in TRUNCATION_MODES:
            raise DataError(f"truncation_mode {spec.truncation_mode!r}: use one of {', '.join(TRUNCATION_MODES)}")
        if spec.max_prompt_length is not None and spec.max_prompt_length < 1:
            raise DataError(f"max_prompt_length must be at least 1, got {spec.max_prompt_length}")
        if spec.trl_tokenization not in TRL_TOKENIZATIONS:
            raise DataError(f"trl_tokenization {spec.trl_tokenization!r}: use one of {', '.join(TRL_TOKENIZATIONS)}")
        return spec

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> DataSpec:
        """The recipe's ``data`` section, with ``max_prompt_length`` / ``truncation_mode`` from its
        ``preference`` section when it has one and the TRL trainer whose tokenization its objective
        follows (they change how pairs are tokenized; the objective's record says which): ``orpo``
        for ORPO and SimPO (TRL's ``ORPOTrainer`` / ``CPOTrainer``), ``dpo`` for the rest."""
        values = dataclasses.asdict(cls.of(recipe.data))
        section = getattr(recipe, "preference", None)
        for name in ("max_prompt_length", "truncation_mode"):
            if section is not None and getattr(section, name, None) is not None:
                values[name] = getattr(section, name)
        record = objective_record(getattr(recipe, "objective", "sft"))
        values["trl_tokenization"] = record.pair_tokenization(section_of(recipe, record))
        return cls.of(values)


def _as_list(spec: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, (str, os.PathLike)):
        return [os.fspath(spec)]
    return [os.fspath(s) for s in spec]


def _looks_local(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~"))
        or Path(name).suffix.lower() in LOCAL_BUILDERS
        or (os.sep in name and Path(name).parent.exists())
    )


def resolve_sources(spec: str | Sequence[str] | None, base_dir: str | Path | None = None,
                    fetch_dir: str | Path | None = None) -> list[str]:
    """Local paths made absolute (relative to ``base_dir``, else the working directory); Hub names
    (``org/name`` or ``hf://org/name``) kept as names; ``s3://`` objects (any scheme whose record
    says ``data``: :mod:`nxd_finetune.storage.schemes`) fetched into ``fetch_dir`` (the data cache,
    :mod:`nxd_finetune.storage.fetch`) and named by their local copy. A name that
    looks like a file but does not exist raises DataError naming it; other URL schemes raise
    DataError."""
    out = []
    for name in _as_list(spec):
        if fetch_dir is not None and data_scheme(name) is not None:
            out.append(str(fetch_object(name, fetch_dir)))
            continue
        if "://" in name:
            if not name.startswith("hf://"):
                raise DataError(f"data source {name!r}: only local paths, {', '.join(data_forms())} and "
                                "hf://<dataset> are supported")
            out.append(name[len("hf://") :])
            continue
        path = Path(name).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        if path.exists():
            out.append(str(path.resolve()))
        elif _looks_local(name):
            raise DataError(f"data file not found: {path}")
        else:
            out.append(name)
    return out


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def jsonl_values(path: Path) -> list[object]:
    """The values of a JSON-lines file's non-blank lines; ValueError ``line N: <JSON error>`` for
    the first that does not parse."""
    values = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    values.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"line {n}: {e}") from None
    return values


def _bad_json_line(path: Path) -> str | None:
    """``line N: <JSON error>`` for the first line of a JSON-lines file that does not parse."""
    try:
        jsonl_values(path)
    except ValueError as e:
        return str(e)
    return None


def _load_one(source: str, hf_cache: str | None):
    import datasets

    datasets.disable_progress_bars()  # our own progress and summary only; no third-party bars
    # its parse errors are logged before they are raised: ours is the one line that names the culprit
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    path = Path(source)
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise DataError(f"{path} holds splits {', '.join(loaded)}; expected a 'train' split")
                loaded = loaded["train"]
            return loaded
        if path.is_file():
            builder = LOCAL_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"{path}: unsupported file type; use {', '.join(LOCAL_BUILDERS)} or a save_to_disk dir")
            return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=hf_cache)
        if _offline():
            raise DataError(f"{source!r} is not a local file or directory and the Hub is offline (HF_HUB_OFFLINE)")
        return datasets.load_dataset(source, split="train", cache_dir=hf_cache)
    except DataError:
        raise
    except Exception as e:  # parse errors, hub errors: one line naming the source
        bad = _bad_json_line(path) if path.is_file() and path.suffix.lower() == ".jsonl" else None
        if bad is not None:
            raise DataError(f"cannot load dataset {source!r}: {bad}") from e
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"cannot load dataset {source!r}: {type(e).__name__}: {first}") from e


def load_rows(spec: str | Sequence[str], base_dir: str | Path | None = None, hf_cache: str | None = None):
    """A ``datasets.Dataset`` of the rows of one source or several (concatenated in order).

    Sources: ``.jsonl``/``.json``/``.parquet``/``.csv``/``.arrow`` files, ``save_to_disk``
    directories (their ``train`` split if a DatasetDict), or else a Hub dataset name (its ``train``
    split; DataError when offline). Missing files, unreadable data and sources whose columns
    differ raise DataError.
    """
    import datasets

    sources = resolve_sources(spec, base_dir)
    if not sources:
        raise DataError("no data source given")
    parts = [_load_one(s, hf_cache) for s in sources]
    if len(parts) == 1:
        return parts[0]
    try:
        return datasets.concatenate_datasets(parts)
    except Exception as e:
        raise DataError(f"data sources {', '.join(sources)} do not share the same columns: {e}".splitlines()[0]) from e


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over what decides token ids: the backend tokenizer JSON, special tokens, chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [
        type(tokenizer).__name__,
        backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items())),
        json.dumps([tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token]),
        str(getattr(tokenizer, "chat_template", None)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _source_fingerprint(source: str) -> list:
    path = Path(source)
    if path.is_file():
        st = path.stat()
        return [source, st.st_size, st.st_mtime_ns]
    if path.is_dir():
        return [source] + [
            [str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(path.rglob("*"))
            if p.is_file()
        ]
    return [source]  # hub name


def cache_key(spec: DataSpec, tokenizer, train: list[str], eval_: list[str], chat_template: str | None) -> str:
    """Hex key of a tokenized-data cache entry (see the module docstring for what it covers)."""
    payload = {
        "version": CACHE_VERSION,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "train": [_source_fingerprint(s) for s in train],
        "eval": [_source_fingerprint(s) for s in eval_],
        "chat_template": chat_template,
        **{
            k: getattr(spec, k)
            for k in ("eval_fraction", "format", "fields", "max_seq_len", "train_on_prompt", "max_samples")
        },
    }
    if spec.chat_template_kwargs:  # keys of data without them stay as they were
        payload["chat_template_kwargs"] = spec.chat_template_kwargs
    if spec.format == "preference":  # SFT keys stay as they were
        payload |= {"max_prompt_length": spec.max_prompt_length, "truncation_mode": spec.truncation_mode}
        if spec.trl_tokenization != "dpo":  # keys of DPO pairs stay as they were
            payload["trl_tokenization"] = spec.trl_tokenization
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def default_cache_dir(spec: DataSpec) -> Path:
    if spec.cache_dir:
        return Path(spec.cache_dir).expanduser()
    return data_cache()


def _split_eval(rows, fraction: float):
    n = len(rows)
    n_eval = max(1, round(n * fraction))
    if n_eval >= n:
        raise DataError(f"data.eval_fraction={fraction} leaves no training rows out of {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED)).tolist()
    return rows.select(sorted(order[n_eval:])), rows.select(sorted(order[:n_eval]))


def _build_entry(
    spec: DataSpec,
    tokenizer,
    train: list[str],
    eval_: list[str],
    chat_template: str | None,
    base_dir: str | Path | None,
    hf_cache: str,
) -> dict[str, TokenizedDataset]:
    train_rows = load_rows(train, base_dir, hf_cache)
    eval_rows = load_rows(eval_, base_dir, hf_cache) if eval_ else None
    if eval_rows is None and spec.eval_fraction > 0:
        train_rows, eval_rows = _split_eval(train_rows, spec.eval_fraction)
    if spec.max_samples is not None:
        train_rows = train_rows.select(range(min(spec.max_samples, len(train_rows))))
    out = {"train": tokenize_rows(train_rows, spec, tokenizer, chat_template, "data.train")}
    if eval_rows is not None:
        out["eval"] = tokenize_rows(eval_rows, spec, tokenizer, chat_template, "data.eval")
    if len(out["train"]) == 0:
        s = out["train"].stats
        raise DataError(
            f"no training samples left: all {s['dropped']} rows have no trainable token "
            f"within max_seq_len={spec.max_seq_len}"
        )
    return out


def prepare_datasets(
    data: DataSpec | DataSection | Mapping[str, object], tokenizer: PreTrainedTokenizerBase,
    base_dir: str | Path | None = None, use_cache: bool = True
) -> tuple[TokenizedDataset, TokenizedDataset | None]:
    """Tokenized (train, eval) for the recipe's ``data`` section, from the cache when possible.

    ``eval`` is None when neither ``data.eval`` nor ``data.eval_fraction`` is set. Relative paths
    (files, ``chat_template``) are taken from ``base_dir`` (the recipe's folder). ``max_samples``
    caps the training rows (taken from the start, after the eval split).
    """
    spec = DataSpec.of(data)
    entry, train, eval_, chat_template = _locate(spec, tokenizer, base_dir)
    root = entry.parent
    if use_cache and (entry / "meta.json").is_file():
        loaded_eval = entry / "eval.safetensors"
        return (
            TokenizedDataset.load(entry / "train.safetensors"),
            TokenizedDataset.load(loaded_eval) if loaded_eval.is_file() else None,
        )
    built = _build_entry(spec, tokenizer, train, eval_, chat_template, base_dir, str(root / "hf-datasets"))
    if use_cache:
        _write_entry(entry, built)
    return built["train"], built.get("eval")


def cache_entry(data: DataSpec | DataSection | Mapping[str, object], tokenizer: PreTrainedTokenizerBase,
                base_dir: str | Path | None = None) -> Path:
    """The cache directory of the tokenized data of ``data`` (what :func:`prepare_datasets` reads or
    writes); what is stored with the data (a preference set's reference log-probs) goes in it."""
    return _locate(DataSpec.of(data), tokenizer, base_dir)[0]


def _locate(spec: DataSpec, tokenizer, base_dir: str | Path | None) -> tuple[Path, list[str], list[str], str | None]:
    """The cache entry of ``spec``, its train and eval sources resolved, its chat template."""
    if spec.train is None:
        raise DataError("data.train is not set")
    if spec.eval is not None and spec.eval_fraction > 0:
        raise DataError("set either data.eval or data.eval_fraction, not both")
    root = default_cache_dir(spec)
    train, eval_ = resolve_sources(spec.train, base_dir, root), resolve_sources(spec.eval, base_dir, root)
    chat_template = formats.load_chat_template(spec.chat_template, base_dir)
    return root / cache_key(spec, tokenizer, train, eval_, chat_template), train, eval_, chat_template


def _write_entry(entry: Path, built: dict[str, TokenizedDataset]) -> None:
    # Losing a race to an identical entry (same key) is fine.
    with publish_dir(entry, already_published=lambda d: (d / "meta.json").is_file()) as tmp:
        for split, ds in built.items():
            ds.save(tmp / f"{split}.safetensors")
        (tmp / "meta.json").write_text(json.dumps({split: ds.stats for split, ds in built.items()}, indent=1))

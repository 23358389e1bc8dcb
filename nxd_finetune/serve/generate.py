"""Text generation from a trained model on ``transformers`` + ``peft``.

:func:`load_model` turns what ``run`` wrote (or the registry holds) into a ready model:

- an adapter: a directory with ``adapter_config.json`` (ours or PEFT's), a registry REF
  ``REGISTRY/NAME[:VERSION|@TAG]`` (pulled, every sha256 checked) or an ``s3://`` prefix
  (:func:`nxd_finetune.registry.fetch.fetch_adapter`); the base is ``--base`` or else the adapter's
  ``base_model_name_or_path`` (a directory, or ``builtin:tiny-llama``), loaded with
  ``AutoModelForCausalLM.from_pretrained`` and the adapter attached with ``PeftModel.from_pretrained``;
- a ``base_and_adapter`` output (``base/`` + ``adapter/``): that adapter on that base;
- an adapter trained on a quantized base (``model.quantization``; its metadata records the
  settings, :func:`~nxd_finetune.lora.quantized.trained_quantization`): the base quantized as it
  was trained, by the training side's own :func:`~nxd_finetune.lora.quantized.quantize_base`
  (bitsandbytes), so the adapter behaves as trained; ``full_precision`` loads it unquantized;
- an HF checkpoint (a ``merged`` output, a full-SFT output, or any base model): loaded alone.

The tokenizer comes from the adapter directory when it holds one (``run`` saves it there), else
from the model. Prompts are rendered with the tokenizer's chat template (or the one given) and
generated with ``model.generate``; :func:`stream` yields text pieces as they are produced
(``TextIteratorStreamer``), which ``chat`` prints. Generation stops at any of
:func:`stop_token_ids`: the tokenizer's eos, every ``eos_token_id`` of the model's
``generation_config.json`` and the chat template's end-of-turn token (Gemma 3's ``<end_of_turn>``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from nxd_finetune.data.formats import (
    TemplateKwargs,
    end_of_turn_tokens,
    load_chat_template,
    render_chat,
    template_kwargs_problem,
)
from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.lora.io import check_adapter_files
from nxd_finetune.lora.quantized import describe, trained_quantization
from nxd_finetune.models import check_checkpoint_files, resolve_dtype
from nxd_finetune.models.loading import GENERATION_CONFIG
from nxd_finetune.registry.fetch import fetch_adapter

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
Message = Mapping[str, str]


@dataclasses.dataclass
class GenerationConfig:
    """Sampling settings; ``temperature == 0`` is greedy decoding (``top_p`` then unused)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise NxdError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise NxdError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise NxdError(f"--top-p must be in (0, 1], got {self.top_p}")

    def generate_kwargs(self) -> dict[str, bool | float | None]:
        if self.temperature == 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": None}


@dataclasses.dataclass
class LoadedModel:
    """``model``: a ``PreTrainedModel`` or a ``PeftModel`` (eval mode); ``description``: what was
    loaded, for messages (the pinned registry REF of a pulled adapter); ``stop_ids``: the ids
    generation stops at (:func:`stop_token_ids`)."""

    model: Any  # a PreTrainedModel or a PeftModel around one (whose generate mypy cannot see: nn.Module.__getattr__)
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    description: str
    stop_ids: tuple[int, ...]
    adapter_dir: Path | None = None
    base_dir: Path | None = None


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cpu``, ``cuda``, ``cuda:N`` as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise NxdError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NxdError("device cuda was asked for but no CUDA device is visible")
    if device.type not in ("cpu", "cuda"):
        raise NxdError(f"device {name!r}: generation runs on cpu or cuda")
    return device


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file()


def _base_from_adapter(adapter_dir: Path, source: str) -> str:
    try:
        base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{source}: unreadable {ADAPTER_CONFIG}: {e}") from None
    if not base:
        raise ModelLoadError(f"{source}: {ADAPTER_CONFIG} names no base_model_name_or_path; pass --base")
    return str(base)


def _resolve_base(base: str, what: str) -> Path:
    try:
        return resolve_model_dir(base)
    except ModelLoadError:
        raise ModelLoadError(f"{what} {base!r} is not a model directory (no config.json); pass --base DIR") from None


def _load_tokenizer(*dirs: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    source = next((d for d in dirs if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
    if source is None:
        raise ModelLoadError(f"no tokenizer files in {', '.join(str(d) for d in dirs)}")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_hf(model_dir: Path, dtype: torch.dtype | str, device: torch.device) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    check_checkpoint_files(model_dir)  # what merge and the trainer refuse, refused here with the same line
    generation_eos_ids(model_dir)  # a bad generation_config.json: one line before the weights are read
    try:
        with _no_loading_bar():
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the model in {model_dir}: {str(e).splitlines()[0]}") from None
    return model.to(device).eval()  # type: ignore[arg-type]  # transformers' stub of .to


@contextlib.contextmanager
def _no_loading_bar() -> Iterator[None]:
    """transformers' "Loading weights" progress bar off for the ``with`` block (the console shows
    the completion only), restored after."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def generation_eos_ids(model_dir: Path) -> list[int]:
    """The ``eos_token_id`` of ``model_dir``'s ``generation_config.json``, an id or a list of ids
    (Gemma 3: ``[1, 106]``, ``<eos>`` and ``<end_of_turn>``); [] without the file or the key."""
    path = model_dir / GENERATION_CONFIG
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable: {e}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    eos = data.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(type(i) is int and i >= 0 for i in ids):
        raise ModelLoadError(f"{path}: eos_token_id must be a token id or a list of token ids, got {eos!r}"[:300])
    return ids


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: Path | None, chat_template: str | None = None,
                   template_kwargs: TemplateKwargs | None = None) -> tuple[int, ...]:
    """The ids generation stops at: the tokenizer's eos, every ``eos_token_id`` of
    ``model_dir``'s ``generation_config.json`` (what ``transformers`` stops at when given no eos)
    and the special tokens ``chat_template`` (None: the tokenizer's) closes an assistant turn with
    (:func:`~nxd_finetune.data.formats.end_of_turn_tokens`), in that order, each once."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    ids += generation_eos_ids(model_dir) if model_dir is not None else []
    for token in end_of_turn_tokens(tokenizer, chat_template, template_kwargs):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.append(token_id)
    return tuple(dict.fromkeys(ids))


def _loaded(model: Any, tokenizer_dirs: Sequence[Path], model_dir: Path, dev: torch.device, description: str,
            chat_template: str | None, template_kwargs: TemplateKwargs | None,
            adapter_dir: Path | None = None) -> LoadedModel:
    tokenizer = _load_tokenizer(*tokenizer_dirs)
    stop = stop_token_ids(tokenizer, model_dir, chat_template, template_kwargs)
    return LoadedModel(model, tokenizer, dev, description, stop, adapter_dir=adapter_dir, base_dir=model_dir)


@contextlib.contextmanager
def load_model(adapter: str | None, base: str | None = None, device: str = "auto", dtype: str | None = None,
               chat_template: str | None = None, template_kwargs: TemplateKwargs | None = None,
               full_precision: bool = False) -> Iterator[LoadedModel]:
    """The model ``adapter`` / ``base`` name (see the module docstring), ready to generate; a pulled
    adapter's temporary copy lives until the ``with`` block ends. ``dtype``: fp32 | bf16 | fp16
    (default: the checkpoint's own). ``chat_template`` / ``template_kwargs``: the template prompts
    are rendered with (None: the tokenizer's), whose end-of-turn token stops generation.
    ``full_precision``: an adapter trained on a quantized base gets the base unquantized. Raises
    NxdError subclasses with one line."""
    torch_dtype = resolve_dtype(dtype) if dtype else "auto"
    dev = resolve_device(device)
    if adapter is None:
        if base is None:
            raise NxdError("give --adapter (a directory, REGISTRY/NAME[:V|@TAG] or s3:// prefix) or --base")
        base_dir = _resolve_base(base, "--base")
        yield _loaded(_load_hf(base_dir, torch_dtype, dev), [base_dir], base_dir, dev, str(base),
                      chat_template, template_kwargs)
        return
    local = Path(adapter).expanduser()
    if "://" not in adapter and _is_checkpoint(local):
        if base is not None:
            raise NxdError(f"--adapter {adapter} is a whole model (merged or full SFT); --base applies to adapters")
        yield _loaded(_load_hf(local, torch_dtype, dev), [local], local, dev, adapter, chat_template,
                      template_kwargs)
        return
    if "://" not in adapter and (local / "adapter" / ADAPTER_CONFIG).is_file():  # base_and_adapter output
        adapter = str(local / "adapter")
        if base is None and (local / "base" / "config.json").is_file():
            base = str(local / "base")
    with fetch_adapter(adapter, "--adapter") as fetched:
        check_adapter_files(fetched.path)  # as merge and lora.init_from check it, before PEFT reads it
        base_name = base if base is not None else _base_from_adapter(fetched.path, adapter)
        base_dir = _resolve_base(base_name, "--base" if base is not None else "the adapter's base model")
        recorded = None if full_precision else trained_quantization(fetched.path)
        model = _load_hf(base_dir, torch_dtype, dev)
        description = fetched.lineage or adapter
        if recorded is not None:
            _quantize_as_trained(model, recorded, fetched.path, dev)
            description += f" on its {describe(recorded)} base"
        yield _loaded(_attach_adapter(model, fetched.path), [fetched.path, base_dir], base_dir, dev, description,
                      chat_template, template_kwargs, adapter_dir=fetched.path)


def _quantize_as_trained(model: PreTrainedModel, recorded: JsonObject, adapter_dir: Path, device: torch.device
                         ) -> None:
    """Quantize ``model``'s frozen base as the adapter in ``adapter_dir`` was trained on it
    (``recorded``: its metadata) with the training side's :func:`quantize_base`: every linear but
    ``lm_head`` and those the adapter trains whole (``modules_to_save``), which stay as loaded."""
    from nxd_finetune.lora.quantized import INSTALL_HINT, QuantSpec, quantize_base, require_bitsandbytes
    from nxd_finetune.lora.quantized_embedding import quantize_embeddings

    spec = QuantSpec.from_json(recorded, str(adapter_dir))
    try:
        require_bitsandbytes()
    except NxdError:
        raise NxdError(f"{adapter_dir} was trained on a {describe(recorded)} base: loading it as trained needs "
                       f"bitsandbytes ({INSTALL_HINT}); or pass --full-precision") from None
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("modules_to_save") or []
    model.requires_grad_(False)
    for name, module in model.named_modules():
        if name.split(".")[-1] in saved:
            module.requires_grad_(True)  # quantize_base leaves trainable weights as they are
    quantize_base(model, spec, device)
    quantize_embeddings(model, spec, device)  # recorded embeddings: true: the embedding and head in 4 bits too
    model.requires_grad_(False)


def _attach_adapter(model: PreTrainedModel, adapter_dir: Path) -> PeftModel:
    try:
        with warnings.catch_warnings():
            # peft imports bitsandbytes where it is installed (the [qlora] extra), which compiles a
            # kernel on import: torch's own DeprecationWarning about torch.jit, nothing a user can act on
            warnings.filterwarnings("ignore", message="`torch.jit.script_method` is deprecated",
                                    category=DeprecationWarning)
            from peft import PeftModel
    except ImportError:
        raise NxdError("generating with an adapter needs the peft package: pip install 'nxd-finetune[serve]'") from None

    try:
        with warnings.catch_warnings():
            # PEFT reads the model's deprecated is_gradient_checkpointing (transformers' FutureWarning,
            # nothing a user can act on)
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            return PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise ModelLoadError(f"adapter {adapter_dir} does not load on this base: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------- prompts


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message] | None = None, text: str | None = None,
               chat_template: str | None = None, template_kwargs: TemplateKwargs | None = None) -> list[int]:
    """Token ids to generate from: ``messages`` rendered with the chat template (seeing
    ``template_kwargs``, the recipe's ``data.chat_template_kwargs``) and the generation prompt (the
    template writes any BOS itself), or plain ``text`` tokenized as the model's tokenizer does by
    default (with its BOS). Exactly one of the two."""
    if (messages is None) == (text is None):
        raise NxdError("give either messages or a plain text prompt")
    if text is not None:
        return list(tokenizer(text)["input_ids"])
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise NxdError("the tokenizer has no chat template: pass --chat-template (a Jinja file or string), "
                       "or --raw with --prompt")
    rendered = render_chat(tokenizer, list(messages or []), chat_template, True, template_kwargs)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def read_messages(path: Path) -> list[dict[str, str]]:
    """A JSON file holding a list of ``{"role", "content"}`` messages, or an object with a
    ``messages`` list (one line of a ``messages``-format dataset)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NxdError(f"--messages {path}: {e}".splitlines()[0]) from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in data):
        raise NxdError(f"--messages {path}: expected a list of {{\"role\": ..., \"content\": ...}} messages")
    return data


def load_template(chat_template: str | None) -> str | None:
    """``--chat-template``: a Jinja file, an inline template, or None (the tokenizer's)."""
    if chat_template is None:
        return None
    return load_chat_template(chat_template, None)


def load_template_kwargs(text: str | None) -> TemplateKwargs | None:
    """``--chat-template-kwargs``: a JSON object of template variables (``{"enable_thinking": false}``),
    checked as the recipe's ``data.chat_template_kwargs``; NxdError (one line) otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise NxdError(f"--chat-template-kwargs is not JSON: {e}") from None
    problem = template_kwargs_problem(value, "--chat-template-kwargs")
    if problem:
        raise NxdError(problem)
    return cast("TemplateKwargs", value) or None


# ---------------------------------------------------------------- generation


def _inputs(loaded: LoadedModel, ids: Sequence[int]) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=loaded.device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def _special_ids(loaded: LoadedModel) -> dict[str, int | list[int] | None]:
    return {"pad_token_id": loaded.tokenizer.pad_token_id, "eos_token_id": list(loaded.stop_ids) or None}


def generate_ids(loaded: LoadedModel, ids: Sequence[int], config: GenerationConfig) -> list[int]:
    """The new token ids ``model.generate`` produces after ``ids`` (the stop id included when reached)."""
    if config.seed is not None:
        torch.manual_seed(config.seed)
    with torch.no_grad():
        out = loaded.model.generate(**_inputs(loaded, ids), max_new_tokens=config.max_new_tokens,
                                    **config.generate_kwargs(), **_special_ids(loaded))
    return out[0, len(ids):].tolist()


def generate_batch(loaded: LoadedModel, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                   batch_size: int = 16) -> list[list[int]]:
    """:func:`generate_ids` for many prompts, ``batch_size`` at a time (left-padded, with the
    attention mask); each result ends at its first stop id."""
    if config.seed is not None:
        torch.manual_seed(config.seed)
    pad = loaded.tokenizer.pad_token_id
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        width = max(len(p) for p in chunk)
        input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = loaded.model.generate(input_ids=input_ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                                        max_new_tokens=config.max_new_tokens, **config.generate_kwargs(),
                                        **_special_ids(loaded))
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in loaded.stop_ids), len(row))
            results.append(row[:end])
    return results


def decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    return cast(str, tokenizer.decode(list(ids), skip_special_tokens=True))  # one sequence: one string


def stream(loaded: LoadedModel, ids: Sequence[int], config: GenerationConfig) -> Iterator[str]:
    """Text pieces of the completion as ``generate`` produces them (a ``TextIteratorStreamer`` fed
    from a generation thread); the thread's error, if any, is raised after the last piece."""
    from transformers import TextIteratorStreamer

    if config.seed is not None:
        torch.manual_seed(config.seed)
    streamer = TextIteratorStreamer(loaded.tokenizer, skip_prompt=True, skip_special_tokens=True)
    failure: list[BaseException] = []

    def work() -> None:
        try:
            with torch.no_grad():
                loaded.model.generate(**_inputs(loaded, ids), max_new_tokens=config.max_new_tokens, streamer=streamer,
                                      **config.generate_kwargs(), **_special_ids(loaded))
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)
            streamer.end()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield from streamer
    thread.join()
    if failure:
        raise failure[0]

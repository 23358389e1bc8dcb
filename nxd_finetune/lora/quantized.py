"""A quantized frozen base under LoRA (QLoRA): bitsandbytes' 4-bit (NF4 / FP4) and 8-bit (LLM.int8())
weights and matmuls, the kernels transformers' ``BitsAndBytesConfig`` and peft train QLoRA with.

Nothing here quantizes or multiplies by itself: :func:`quantize_module` hands each frozen linear's
loaded weight (this rank's shard under tensor parallel) to bitsandbytes: 4-bit to ``quantize_4bit``
a chunk at a time into its ``Params4bit`` (:func:`params4bit`: the bytes ``Linear4bit`` gets), int8
to ``Int8Params`` (quantized where it is moved to, as ``Linear8bitLt`` is), and the forward is
``bitsandbytes.matmul_4bit`` / ``bitsandbytes.matmul`` with the casts ``Linear4bit.forward`` /
``Linear8bitLt.forward`` make. Same input weights and settings give the same quantized bytes as
transformers' loader, so the logits equal theirs up to the kernels' rounding.

Which linears: every frozen ``nn.Linear`` / :class:`ColumnParallelLinear` / :class:`RowParallelLinear`
(a LoRA layer's ``base_layer`` or an untargeted one) but the output layer (``lm_head``) and what
``modules_to_save`` trains, as transformers' integration keeps ``lm_head`` in full precision. The
module keeps its class's steps and names (its class becomes the quantized subclass), so the sharded
LoRA layers run on it unchanged; its ``weight`` is then bitsandbytes' packed parameter. A run
quantizes each one as its weight is read (:func:`quantize_on_load`); :func:`quantize_base` does a
loaded model at once.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.parallel.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from nxd_finetune.recipe import QuantizationSection

Method = Literal["nf4", "fp4", "int8"]
INSTALL_HINT = "pip install 'nxd-finetune[qlora]' (bitsandbytes)"
INT8_THRESHOLD = 6.0
"""LLM.int8()'s outlier threshold: ``BitsAndBytesConfig``'s ``llm_int8_threshold`` default."""
KEPT_IN_FULL_PRECISION = ("lm_head",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SETTINGS = ("double_quant", "compute_dtype", "block_size", "embeddings")
"""``model.quantization``'s settings beside ``method``, as adapter metadata records them."""
METADATA_KEY = "nxd_base_quantization"
"""The adapter's safetensors metadata key (where peft does not look) holding the quantization it
was trained on, as JSON (:meth:`QuantSpec.to_json`)."""


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """``model.quantization`` (bitsandbytes' and peft's names): ``method`` nf4 / fp4 (4-bit,
    ``bnb_4bit_quant_type``) or int8 (``load_in_8bit``); ``double_quant`` (``bnb_4bit_use_double_quant``:
    the block scales quantized too), ``compute_dtype`` (``bnb_4bit_compute_dtype``), ``block_size``
    (bitsandbytes' ``blocksize``; transformers always uses 64). The last three are 4-bit only."""

    method: Method
    double_quant: bool = False
    compute_dtype: str = "float32"
    block_size: int = 64
    embeddings: bool = False
    """The input embedding and output layer in 4 bits too (:mod:`.quantized_embedding`)."""

    @classmethod
    def from_section(cls, section: QuantizationSection) -> QuantSpec:
        return cls(section.method, section.double_quant, section.compute_dtype, section.block_size,
                   section.embeddings)

    @classmethod
    def from_json(cls, recorded: JsonObject, source: str) -> QuantSpec:
        """The settings an adapter recorded (:meth:`to_json`, :func:`trained_quantization`), checked
        as ``model.quantization`` is; NxdError (one line naming ``source``) when they are not."""
        from pydantic import ValidationError

        from nxd_finetune.recipe import QuantizationSection

        try:
            return cls.from_section(QuantizationSection.model_validate(recorded_section(recorded)))
        except ValidationError as e:
            raise NxdError(f"{source}: its {METADATA_KEY} metadata {json.dumps(recorded, sort_keys=True)} is not a "
                           f"quantization a run takes: {e.errors()[0]['msg']}") from None

    @property
    def four_bit(self) -> bool:
        return self.method != "int8"

    def to_json(self) -> JsonObject:
        """The settings as adapter metadata records them (with the library and its version)."""
        bnb = require_bitsandbytes()
        out: JsonObject = {"method": self.method, "library": "bitsandbytes", "version": str(bnb.__version__)}
        if self.four_bit:
            out.update(double_quant=self.double_quant, compute_dtype=self.compute_dtype, block_size=self.block_size)
        if self.embeddings:
            out["embeddings"] = True
        return out

    def bnb_config(self) -> JsonObject:
        """The same settings as transformers' ``BitsAndBytesConfig`` keyword arguments."""
        if not self.four_bit:
            return {"load_in_8bit": True, "llm_int8_threshold": INT8_THRESHOLD}
        return {"load_in_4bit": True, "bnb_4bit_quant_type": self.method,
                "bnb_4bit_use_double_quant": self.double_quant, "bnb_4bit_compute_dtype": self.compute_dtype}


def quantization_metadata(section: QuantizationSection | None) -> dict[str, str]:
    """The adapter metadata entry of a run with ``model.quantization`` (empty without)."""
    if section is None:
        return {}
    return {METADATA_KEY: json.dumps(QuantSpec.from_section(section).to_json(), sort_keys=True)}


def trained_quantization(adapter_dir: str | Path) -> JsonObject | None:
    """The quantization an adapter records it was trained on (:data:`METADATA_KEY`), or None."""
    from safetensors import safe_open

    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        recorded = (f.metadata() or {}).get(METADATA_KEY)
    value = json.loads(recorded) if recorded else None
    return value if isinstance(value, dict) else None


def recorded_section(recorded: JsonObject) -> JsonObject:
    """The ``model.quantization`` section of an adapter's recorded settings (the library and its
    version left out)."""
    return {k: v for k, v in recorded.items() if k in ("method", *SETTINGS)}


def describe(recorded: JsonObject) -> str:
    """``nf4 (double_quant true, compute_dtype bfloat16, block_size 64; bitsandbytes 0.50.2)``."""
    settings = ", ".join(f"{k} {json.dumps(recorded[k])}" for k in SETTINGS if k in recorded)
    library = f"{recorded.get('library', 'bitsandbytes')} {recorded.get('version', '')}".strip()
    return f"{recorded.get('method')} ({settings + '; ' if settings else ''}{library})"


def require_bitsandbytes() -> ModuleType:
    """The ``bitsandbytes`` module; NxdError (one line: what to install) when it is missing."""
    try:
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its note on an optional CPU kernel package
        return importlib.import_module("bitsandbytes")
    except ImportError:
        raise NxdError(f"model.quantization needs bitsandbytes, which is not installed: {INSTALL_HINT}") from None


QUANTIZE_CHUNK_ELEMENTS = 2**20
"""The most elements of a weight one ``quantize_4bit`` call quantizes (:func:`params4bit`)."""


def params4bit(weight: torch.Tensor, spec: QuantSpec, device: torch.device) -> nn.Parameter:
    """bitsandbytes' ``Params4bit`` of ``weight`` (frozen) on ``device``, the same bytes and state as
    ``Params4bit(weight).to(device)`` quantizes at once (blocks are quantized independently, then
    double quantization of all the block scales as ``quantize_4bit`` does it: ``quantize_blockwise``
    of the scales less their mean, blocks of 256), but :data:`QUANTIZE_CHUNK_ELEMENTS` at a time
    into outputs allocated first: ``quantize_4bit``'s CPU kernel holds several fp32 copies of its
    input (0.25 GiB for one 8192 x 2048 weight, 3.6 GiB for Llama-3.2-1B's embedding), and the
    packed bytes kept for the run do not land between its temporaries, whose freed space glibc's
    heap would keep resident for the whole run."""
    bnb = require_bitsandbytes()
    functional = bnb.functional
    flat = weight.detach().reshape(-1)
    n, block = flat.numel(), spec.block_size
    step = max(block, QUANTIZE_CHUNK_ELEMENTS // block * block)  # whole blocks but the last chunk's
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=device)
    absmax = torch.empty(-(-n // block), dtype=torch.float32, device=device)
    for start in range(0, n, step):
        data, state = functional.quantize_4bit(flat[start:start + step].to(device), blocksize=block,
                                               quant_type=spec.method, compress_statistics=False)
        packed[start // 2:start // 2 + data.shape[0]] = data
        absmax[start // block:start // block + state.absmax.numel()] = state.absmax
        del data, state
    offset, state2 = None, None
    if spec.double_quant:
        offset = absmax.mean()
        absmax, state2 = functional.quantize_blockwise(absmax - offset, blocksize=256)
    quant_state = functional.QuantState(absmax=absmax, shape=weight.shape, dtype=weight.dtype, blocksize=block,
                                        code=functional.get_4bit_type(spec.method, device=packed.device),
                                        quant_type=spec.method, offset=offset, state2=state2)
    return cast(nn.Parameter, bnb.nn.Params4bit(packed, requires_grad=False, quant_state=quant_state,
                                                blocksize=block, compress_statistics=spec.double_quant,
                                                quant_type=spec.method, quant_storage=torch.uint8,
                                                bnb_quantized=True))


def _quantized_weight(weight: torch.Tensor, spec: QuantSpec, device: torch.device) -> nn.Parameter:
    """bitsandbytes' parameter for ``weight`` (frozen), quantized on ``device``: 4-bit by
    :func:`params4bit`, int8 as ``Int8Params`` quantizes it when moved there."""
    if spec.four_bit:
        return params4bit(weight, spec, device)
    bnb = require_bitsandbytes()
    param = bnb.nn.Int8Params(weight.detach(), requires_grad=False, has_fp16_weights=False)
    return cast(nn.Parameter, param.to(device))


class _Quantized(nn.Module):
    """The forward of a quantized base, ``Linear4bit.forward`` / ``Linear8bitLt.forward``'s calls."""

    quant_spec: QuantSpec
    int8_state: object | None

    def quantized_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        bnb = require_bitsandbytes()
        weight = self.get_parameter("weight")
        if self.quant_spec.four_bit:
            compute = DTYPES[self.quant_spec.compute_dtype]
            out = bnb.matmul_4bit(x.to(compute), weight, bias=None if bias is None else bias.to(compute),
                                  quant_state=weight.quant_state)  # type: ignore[attr-defined]
            return cast(torch.Tensor, out).to(x.dtype)
        state = self.int8_state
        assert state is not None
        state.is_training = self.training  # type: ignore[attr-defined]
        state.CB = weight.data  # type: ignore[attr-defined]
        return cast(torch.Tensor, bnb.matmul(x, weight, bias=None if bias is None else bias.to(x.dtype),
                                             state=state))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quantization={self.quant_spec.method}"


class QuantizedLinear(_Quantized, nn.Linear):
    """A frozen ``nn.Linear`` with a quantized weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized_linear(x, self.bias)


class QuantizedColumnParallelLinear(_Quantized, ColumnParallelLinear):
    """A column-parallel linear whose local shard is quantized (its collectives unchanged)."""

    def local_output(self, x_in: torch.Tensor) -> torch.Tensor:
        return self.quantized_linear(x_in, self.bias)


class QuantizedRowParallelLinear(_Quantized, RowParallelLinear):
    """A row-parallel linear whose local shard is quantized (the bias is added after the reduction)."""

    def local_partial(self, x_l: torch.Tensor) -> torch.Tensor:
        return self.quantized_linear(x_l, None)


_QUANTIZED: dict[type[nn.Module], type[_Quantized]] = {
    nn.Linear: QuantizedLinear,
    ColumnParallelLinear: QuantizedColumnParallelLinear,
    RowParallelLinear: QuantizedRowParallelLinear,
}


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """``module.weight`` as the matmul sees it (detached): bitsandbytes' dequantization of a quantized
    base (``dequantize_4bit`` / ``int8_vectorwise_dequant``), this rank's shard; any other weight as is.
    For what needs the base's values (DoRA's weight norm)."""
    weight = module.get_parameter("weight")
    if not is_quantized(module):
        return weight.detach()
    functional = require_bitsandbytes().functional
    state = getattr(weight, "quant_state", None)
    if state is not None:
        return cast(torch.Tensor, functional.dequantize_4bit(weight.data, state))
    return cast(torch.Tensor, functional.int8_vectorwise_dequant(weight.data, weight.SCB))  # type: ignore[attr-defined]


def parameter_elements(p: torch.Tensor) -> int:
    """Elements of the (local) weight ``p`` stands for: a packed 4-bit weight counts its original
    shape (``quant_state.shape``), as peft counts it; any other tensor its ``numel``."""
    state = getattr(p, "quant_state", None)
    shape = getattr(state, "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else p.numel()


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, _Quantized)


def quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the linears with a frozen weight :func:`quantize_base` quantizes (see the
    module doc; a bias trained in place, ``lora.bias``, stays a plain tensor beside it)."""
    found = []
    for name, module in model.named_modules():
        parts = name.split(".")
        weight = getattr(module, "weight", None)
        if (type(module) in _QUANTIZED and parts[-1] not in KEPT_IN_FULL_PRECISION
                and not {"modules_to_save", "original_module"} & set(parts)
                and isinstance(weight, torch.Tensor) and not weight.requires_grad):
            found.append((name, module))
    return found


def quantize_module(module: nn.Module, spec: QuantSpec, device: torch.device) -> None:
    """Quantize one linear of :func:`quantizable` in place on ``device`` (its loaded weight, this
    rank's shard, is freed once the quantized form exists). NxdError when bitsandbytes is missing or
    the weight is not loaded yet."""
    bnb = require_bitsandbytes()
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    if weight.device.type == "meta":
        raise NxdError(f"cannot quantize a {type(module).__name__}: its weight is not loaded (on the meta device)")
    quantized = _quantized_weight(weight, spec, device)
    module.__class__ = _QUANTIZED[type(module)]
    assert isinstance(module, _Quantized)
    module.weight = quantized  # type: ignore[assignment]  # bitsandbytes' Parameter subclass
    module.quant_spec = spec
    module.int8_state = None
    if not spec.four_bit:
        state = bnb.MatmulLtState()
        state.threshold, state.has_fp16_weights, state.use_pool = INT8_THRESHOLD, False, True
        state.SCB = quantized.SCB  # type: ignore[attr-defined]
        module.int8_state = state


def quantize_base(model: nn.Module, spec: QuantSpec, device: torch.device) -> list[str]:
    """Quantize ``model``'s frozen linears (:func:`quantizable`; those not quantized yet) in place on
    ``device``, one at a time; returns their names."""
    names = []
    for name, module in quantizable(model):
        quantize_module(module, spec, device)
        names.append(name)
    return names


def quantize_on_load(model: nn.Module, spec: QuantSpec, device: torch.device) -> Callable[[nn.Module, str], None]:
    """For a model on the meta device (LoRA injected): the ``tensor_loaded`` hook that quantizes each
    of its :func:`quantizable` linears as soon as its weight is read, so loading holds one weight in
    the file's dtype at a time rather than the whole (stage of the) model. Every other tensor read
    is copied into memory of its own: read in the file's dtype it is a view of the checkpoint's
    memory map, which would keep every page the quantization read resident (and counted in the
    process's memory) for the whole run; with no view left, the map goes when the file is closed."""
    pending = {id(m) for _, m in quantizable(model)}

    def loaded(module: nn.Module, attr: str) -> None:
        if attr == "weight" and id(module) in pending:
            pending.discard(id(module))
            quantize_module(module, spec, device)
        else:
            tensor = getattr(module, attr)
            if not tensor.untyped_storage().resizable():  # a view of a memory map (a read of its own is not)
                with torch.no_grad():
                    tensor.data = tensor.data.clone()

    return loaded

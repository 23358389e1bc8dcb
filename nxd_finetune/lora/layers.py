"""LoRA layers: ``LoraLinear`` around a frozen linear, and ``ModulesToSaveWrapper``.

Parameter names follow PEFT without the adapter name, so a wrapped ``q_proj`` holds
``q_proj.base_layer.weight``, ``q_proj.lora_A.weight`` and ``q_proj.lora_B.weight``, and PEFT's
checkpoint keys map onto them directly.

Sharded bases: :mod:`nxd_finetune.lora.sharded` subclasses :class:`LoraLinear` for the
column- and row-parallel linears and registers the subclasses with :func:`register_lora_layer`,
so ``inject_lora`` picks them by base type. Their factors are this rank's slices (``lora_A`` /
``lora_B`` carry ``placements`` like the parallel layers); ``delta_weight()`` is then the local
shard's delta, which is what ``merge()`` adds to the local base shard.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# base layer type -> LoRA wrapper type; looked up along the base type's MRO
_LORA_LAYERS: dict[type[nn.Module], type[LoraLinear]] = {}


def register_lora_layer(base_type: type[nn.Module], lora_type: type[LoraLinear]) -> None:
    """Make ``inject_lora`` wrap modules of ``base_type`` (and subclasses) with ``lora_type``."""
    _LORA_LAYERS[base_type] = lora_type


def lora_layer_for(module: nn.Module) -> type[LoraLinear] | None:
    """The LoRA wrapper registered for ``type(module)``, or None when it cannot be wrapped."""
    for cls in type(module).__mro__:
        if cls in _LORA_LAYERS:
            return _LORA_LAYERS[cls]
    return None


@torch.no_grad()
def init_lora_factors(a: torch.Tensor, b: torch.Tensor, r: int, init_lora_weights: str = "default") -> None:
    """PEFT's init of ``a`` (``lora_A.weight``, ``[r, in]``) and ``b`` (``lora_B.weight``), in place:
    A kaiming-uniform(a=sqrt(5)) (``default``) or N(0, std=1/r) (``gaussian``); B zero.
    Raises ValueError for another ``init_lora_weights``."""
    if init_lora_weights == "default":
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
    elif init_lora_weights == "gaussian":
        nn.init.normal_(a, std=1 / r)
    else:
        raise ValueError(f"unknown init_lora_weights {init_lora_weights!r}")
    nn.init.zeros_(b)


class LoraLinear(nn.Module):
    """``y = base(x) + B(A(dropout(x))) * scaling`` around a frozen linear ``base``.

    ``base``: ``nn.Linear``-like (``weight [out, in]``, optional ``bias [out]``); its parameters
    are frozen here and stay the same tensors (so ``bias`` modes and weight tying keep working).
    ``in_features``/``out_features`` default to the base's (the full sizes for a sharded base).
    ``lora_A``: ``nn.Linear(in, r, bias=False)``, ``lora_B``: ``nn.Linear(r, out, bias=False)``,
    created in the base weight's dtype on its device (on CPU when the base is on the meta device,
    so that checkpoint materialisation, which fills only meta tensors, leaves them alone).
    The LoRA path runs in ``lora_A``'s dtype and the result is cast back to the base output's
    dtype, as PEFT does. With ``merged`` set, ``forward`` is the base alone.
    """

    base_layer: nn.Module
    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module

    def __init__(
        self,
        base: nn.Module,
        r: int,
        lora_alpha: float,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: str = "default",
        in_features: int | None = None,
        out_features: int | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base
        for p in base.parameters():
            p.requires_grad_(False)
        in_f = in_features if in_features is not None else base.in_features
        out_f = out_features if out_features is not None else base.out_features
        assert isinstance(in_f, int) and isinstance(out_f, int), "the base must be linear-like"
        self.in_features, self.out_features = in_f, out_f
        self.r = r
        self.lora_alpha = lora_alpha
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout = nn.Dropout(p=lora_dropout) if lora_dropout > 0 else nn.Identity()
        weight = self.weight
        device = torch.device("cpu") if weight.device.type == "meta" else weight.device
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device, dtype=dtype)
        self.merged = False
        self.reset_lora_parameters(init_lora_weights)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (merged or not, as ``merged`` says)."""
        weight = self.base_layer.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.base_layer.bias
        assert bias is None or isinstance(bias, torch.Tensor)
        return bias

    def __setattr__(self, name: str, value: Any) -> None:
        # Assigning ``weight``/``bias`` (weight tying by ``tie_weights``, a TP plan swapping in a
        # shard) targets the base layer, so LoraLinear stays a drop-in for the linear it wraps.
        if name in ("weight", "bias") and "base_layer" in self.__dict__.get("_modules", {}):
            setattr(self.base_layer, name, value)
        else:
            super().__setattr__(name, value)

    @torch.no_grad()
    def reset_lora_parameters(self, init_lora_weights: str = "default") -> None:
        """PEFT's init (see :func:`init_lora_factors`); a fresh adapter leaves the output unchanged."""
        init_lora_factors(self.lora_A.weight, self.lora_B.weight, self.r, init_lora_weights)

    def delta_weight(self) -> torch.Tensor:
        """``B @ A * scaling`` in fp32, the shape of the (local) base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in, as a new tensor in the base dtype (the
        module is not changed). Equals ``weight`` when already merged."""
        w = self.weight
        if self.merged:
            return w.detach().clone()
        return (w.detach().float() + self.delta_weight().to(w.device)).to(w.dtype)

    def unmerged_weight(self) -> torch.Tensor:
        """The original base weight, as a tensor (a new one when the module is merged)."""
        w = self.weight
        if not self.merged:
            return w.detach()
        return (w.detach().float() - self.delta_weight().to(w.device)).to(w.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ``B @ A * scaling`` into the base weight in place; a no-op when already merged."""
        if not self.merged:
            self.base_layer.weight.data = self.merged_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the adapter from the base weight again; a no-op when not merged. In bf16/fp16
        the round trip is exact only to the base dtype's rounding."""
        if self.merged:
            self.base_layer.weight.data = self.unmerged_weight()
            self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged:
            return result
        lora_x = x if self._autocast_keeps(x) else x.to(self.lora_A.weight.dtype)
        # scaling applied to the r-wide intermediate, not the out-wide product: one elementwise pass
        # over [N, r] instead of [N, out] forward and backward (bit-identical for power-of-two scaling)
        out = result + self.lora_B(self.lora_A(self.lora_dropout(lora_x)) * self.scaling)
        return out.to(result.dtype)

    def _autocast_keeps(self, x: torch.Tensor) -> bool:
        """True when autocast would cast the factors' input back to ``x``'s dtype anyway (fp32
        factors in a bf16 model under bf16 autocast, no dropout): casting ``x`` up first would give
        the same numbers but make ``lora_A`` keep its own rounded copy of ``x`` for backward, one
        per LoRA module (q, k and v each), instead of the one tensor they share."""
        return (isinstance(self.lora_dropout, nn.Identity) and torch.is_autocast_enabled(x.device.type)
                and torch.get_autocast_dtype(x.device.type) == x.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}, merged={self.merged}"


register_lora_layer(nn.Linear, LoraLinear)


class ModulesToSaveWrapper(nn.Module):
    """A module trained in full (PEFT's ``modules_to_save``): ``original_module`` keeps the frozen
    base, ``modules_to_save`` is a trainable deep copy that ``forward`` uses.

    Keeping the original lets ``base_and_adapter`` saves write the untouched base. The copy does
    not share weights with anything (a tied ``lm_head`` copy is untied), as in PEFT.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.original_module = module
        # a sharded module holds its process group, which cannot be copied: the copy shares it
        groups = {id(v): v for m in module.modules() for v in vars(m).values() if isinstance(v, dist.ProcessGroup)}
        self.modules_to_save = copy.deepcopy(module, groups)
        for p in module.parameters():
            p.requires_grad_(False)
        for p in self.modules_to_save.parameters():
            p.requires_grad_(True)

    @property
    def weight(self) -> torch.Tensor:
        """The *original* module's weight: what weight tying shares (as in PEFT without
        ``ensure_weight_tying``). The trained copy is ``modules_to_save.weight``."""
        weight = self.original_module.weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def __setattr__(self, name: str, value: Any) -> None:
        # Weight tying after injection (``tie_weights`` on a model injected on the meta device):
        # the original takes the shared tensor, a copy never materialised gets its own clone.
        if (
            name == "weight"
            and isinstance(value, nn.Parameter)
            and "original_module" in self.__dict__.get("_modules", {})
        ):
            self.original_module.weight = value
            if self.modules_to_save.weight.device.type == "meta":
                self.modules_to_save.weight = nn.Parameter(value.detach().clone())
        else:
            super().__setattr__(name, value)

    def forward(self, *args: object, **kwargs: object) -> object:
        """The copy's forward. Floating inputs are cast to the copy's dtype and a floating output
        back to the original's, so a copy upcast to fp32 for training runs inside a bf16 model."""
        copy_p = next(self.modules_to_save.parameters(), None)
        orig_p = next(self.original_module.parameters(), None)
        if copy_p is None or orig_p is None or copy_p.dtype == orig_p.dtype:
            return self.modules_to_save(*args, **kwargs)
        args = tuple(a.to(copy_p.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        out = self.modules_to_save(*args, **kwargs)
        return out.to(orig_p.dtype) if torch.is_tensor(out) and out.is_floating_point() else out

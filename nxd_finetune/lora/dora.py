"""DoRA (weight-decomposed LoRA, Liu et al. 2024) as PEFT's ``use_dora``.

Each DoRA layer holds, besides the LoRA factors, a trained magnitude ``m [out]``
(``lora_magnitude_vector``, PEFT's file key; here a parameter of the LoRA module, so the model
name is the file key). With ``n = ||W + s B A||`` per output row (dim 1 of ``W [out, in]``,
*detached*, as PEFT does after sec. 4.3 of the paper) and ``f = m / n``::

    y = base(x) + (f - 1) * (W x) + f * s * B A x          (PEFT's ``DoraLinearLayer.forward``)

``W x`` is the base output less its bias, or, with dropout while training, ``W drop(x)`` (one more
matmul, as PEFT). A fresh adapter (``B = 0``) starts with ``m = ||W||``, so ``f = 1`` and the output
is the base's. ``merge`` folds ``f (W + s B A)`` into the weight (PEFT's ``merge``), with ``n``
from the unmerged weight, kept for ``unmerge``.

Tensor parallel (:mod:`nxd_finetune.lora.sharded` for the layouts): ``n`` is a row norm, so a
column-parallel layer (``W`` split on out) computes its rows' norms locally and ``m`` is split
like ``lora_B``'s rows; a row-parallel layer (``W`` split on in) sums the squares of its slice's
rows over the TP group (one all-reduce of ``out`` floats per forward) and ``m`` is whole, like
``lora_B``. ``m``'s placement is ``lora_B``'s on the out dim, so its gradient is exact or partial
exactly where ``lora_B``'s is.

On a quantized base (:mod:`nxd_finetune.lora.quantized`, QLoRA) ``W`` is the dequantized weight, as
PEFT's DoRA on bitsandbytes' layers reads it: in the norm, in ``W drop(x)`` and in ``m``'s initial
``||W||``; quantize the base before :func:`init_dora_magnitudes`.

A model injected on the meta device has no base weights to take ``||W||`` from: its magnitudes
are set by :func:`init_dora_magnitudes` once the weights are read (or loaded from an adapter);
until then ``forward`` refuses to run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora.layers import LoraLinear
from nxd_finetune.lora.quantized import dequantized_weight
from nxd_finetune.lora.sharded import ColumnParallelLoraLinear, RowParallelLoraLinear
from nxd_finetune.parallel.layers import ColumnParallelLinear, RowParallelLinear
from nxd_finetune.parallel.mappings import all_reduce_sum

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from 3.11; the package needs 3.10

__all__ = ["MAGNITUDE", "DoraLinear", "dora_fold", "dora_layer_for", "init_dora_magnitudes"]

MAGNITUDE = "lora_magnitude_vector"


class LoraOptions(TypedDict, total=False):
    """The LoRA layers' keyword options (``inject_lora`` passes them by name)."""

    lora_dropout: float
    use_rslora: bool
    init_lora_weights: str


def row_norm_sq(weight: torch.Tensor) -> torch.Tensor:
    """Sum of squares per output row of ``weight [out, in]``, fp32."""
    return weight.float().square().sum(dim=1)


def dora_fold(weight: torch.Tensor, magnitude: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
    """``(m / n)[:, None] * weight``: PEFT's merged DoRA weight from ``weight = W + s B A`` (fp32),
    ``n`` its row norms unless given (a shard's rows summed over TP)."""
    n = row_norm_sq(weight).sqrt() if norm is None else norm
    return (magnitude.float() / n).view(-1, 1) * weight


class DoraLinear(LoraLinear):
    """:class:`LoraLinear` with PEFT's DoRA magnitude (see the module docstring). The sharded
    variants override :meth:`forward` and reduce the squared norms over TP where ``W`` is split on
    its input dim."""

    lora_magnitude_vector: nn.Parameter

    def __init__(self, base: nn.Module, r: int, lora_alpha: float, **options: Unpack[LoraOptions]) -> None:
        super().__init__(base, r, lora_alpha, **options)  # the LoRA layer's (full factors, sliced when sharded)
        b = self.lora_B.weight
        self.lora_magnitude_vector = nn.Parameter(b.new_ones(b.shape[0]))
        placement = getattr(self.lora_B, "placements", {}).get("weight")
        if placement is not None:  # m [out] is placed like lora_B [out, r] on its rows
            # torch's stub types Module.__setattr__ for tensors and modules only; plain attributes are fine
            self.placements = {MAGNITUDE: placement.with_shape((placement.full_shape[0],))}  # type: ignore[assignment]
        self.magnitude_pending = self.weight.device.type == "meta"
        if not self.magnitude_pending:
            self.reset_magnitude()

    def base_weight(self) -> torch.Tensor:
        """The (local) base weight as the matmul sees it, detached: a quantized base dequantized
        (PEFT's ``dequantize_module_weight``), for the norm and ``W drop(x)``."""
        return dequantized_weight(self.base_layer)

    def _reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        """The full rows' sums of squares from this rank's (identity unless ``W`` is split on in)."""
        return sq

    @torch.no_grad()
    def weight_norm(self) -> torch.Tensor:
        """``||W + s B A||`` per output row of the unmerged weight, fp32, no gradient (collective
        over TP for a row-parallel base)."""
        w = self.unmerged_weight().float()
        return self._reduce_norm_sq(row_norm_sq(w + self.delta_weight().to(w.device))).sqrt()

    @torch.no_grad()
    def reset_magnitude(self) -> None:
        """``m = ||W + s B A||``: PEFT's initial magnitude (``||W||`` for a fresh adapter)."""
        self.lora_magnitude_vector.copy_(self.weight_norm().to(self.lora_magnitude_vector))
        self.magnitude_pending = False

    def _scale(self) -> torch.Tensor:
        """``m / n``, one factor per output feature (of this rank's rows)."""
        if self.magnitude_pending:
            raise AdapterError("a DoRA layer's magnitude was never set: call init_dora_magnitudes(model) after "
                               "the base weights are read, or load an adapter")
        return self.lora_magnitude_vector / self.weight_norm().to(self.lora_magnitude_vector)

    def _dora(self, plain: torch.Tensor, lora: torch.Tensor) -> torch.Tensor:
        """What DoRA adds to the base output: ``(f - 1) * W x + f * s * B A x``."""
        f = self._scale()
        return (f - 1) * plain + f * lora * self.scaling

    def _dropping(self) -> bool:
        return self.training and isinstance(self.lora_dropout, nn.Dropout)

    def _plain(self, result: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """``W x`` of the local weight: the base output less its bias, or ``W drop(x)`` (PEFT)."""
        if self._dropping():
            return F.linear(dropped, self.base_weight().to(dropped.dtype))
        return result - self.bias if self.bias is not None else result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged:
            return result
        lora_x = x if self._autocast_keeps(x) else x.to(self.lora_A.weight.dtype)
        dropped = self.lora_dropout(lora_x)
        out = result + self._dora(self._plain(result, dropped), self.lora_B(self.lora_A(dropped)))
        return out.to(result.dtype)

    def merged_weight(self) -> torch.Tensor:
        w = self.weight
        if self.merged:
            return w.detach().clone()
        full = w.detach().float() + self.delta_weight().to(w.device)
        return dora_fold(full, self.lora_magnitude_vector.detach(), self.weight_norm()).to(w.dtype)

    def unmerged_weight(self) -> torch.Tensor:
        w = self.weight
        if not self.merged:
            return self.base_weight()
        f = self.lora_magnitude_vector.detach().float() / self._merged_norm
        return (w.detach().float() / f.view(-1, 1) - self.delta_weight().to(w.device)).to(w.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """PEFT's DoRA merge: ``W <- (m / n) (W + s B A)``; ``n`` is kept for :meth:`unmerge`."""
        if not self.merged:
            norm = self.weight_norm()
            self.base_layer.weight.data = self.merged_weight()
            self._merged_norm = norm
            self.merged = True

    def extra_repr(self) -> str:
        return super().extra_repr() + ", dora=True"


class ColumnParallelDoraLinear(DoraLinear, ColumnParallelLoraLinear):
    """DoRA around a :class:`ColumnParallelLinear`: this rank's rows, their norms local, ``m``
    split like ``lora_B``."""

    base_layer: ColumnParallelLinear

    forward = ColumnParallelLoraLinear.forward  # the LoRA layer's steps, with DoRA's term

    def _added(self, y: torch.Tensor, lora_x: torch.Tensor) -> torch.Tensor:
        dropped = self.lora_dropout(lora_x)
        return self._dora(self._plain(y, dropped), self.lora_B(self.lora_A(dropped)))


class RowParallelDoraLinear(DoraLinear, RowParallelLoraLinear):
    """DoRA around a :class:`RowParallelLinear`: the rows' squared norms summed over TP, ``m``
    whole like ``lora_B``; with dropout while training ``W drop(x)`` is reduced too."""

    base_layer: RowParallelLinear

    def _reduce_norm_sq(self, sq: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(sq, self.base_layer.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.merged:
            return base(x)
        x_l = base.parallel_input(x)
        plain = base.reduce(base.local_partial(x_l))
        y = base.add_bias(plain)
        lora_x = x_l if self._autocast_keeps(x_l) else x_l.to(self.lora_A.weight.dtype)
        dropped = self._drop_local(lora_x)
        if self._dropping():
            plain = base.reduce(F.linear(dropped, self.base_weight().to(dropped.dtype)))
        lora = self.lora_B(base.reduce(self.lora_A(dropped)))
        return (y + self._dora(plain, lora)).to(y.dtype)


_DORA_LAYERS: dict[type[LoraLinear], type[DoraLinear]] = {
    LoraLinear: DoraLinear,
    ColumnParallelLoraLinear: ColumnParallelDoraLinear,
    RowParallelLoraLinear: RowParallelDoraLinear,
}


def dora_layer_for(lora_type: type[LoraLinear], name: str) -> type[DoraLinear]:
    """The DoRA version of a LoRA layer type; AdapterError naming module ``name`` when there is none."""
    found = _DORA_LAYERS.get(lora_type)
    if found is None:
        raise AdapterError(f"lora.use_dora: {name} would be a {lora_type.__name__}, which has no DoRA version")
    return found


def init_dora_magnitudes(*models: nn.Module) -> None:
    """Set ``m = ||W + s B A||`` on every DoRA layer of ``models`` whose magnitude was never set (it
    was injected on the meta device); call it after the base weights are read. Collective over TP
    for row-parallel layers (every rank calls it, same modules)."""
    for model in models:
        for m in model.modules():
            if isinstance(m, DoraLinear) and m.magnitude_pending:
                m.reset_magnitude()

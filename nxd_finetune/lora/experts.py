"""LoRA on the fused expert tensors of a mixture-of-experts model, as PEFT's ``target_parameters``
(``peft.tuners.lora.layer.ParamWrapper``) puts it there, so the adapter files are PEFT's.

For a fused tensor ``W [E, out, in]`` (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``) PEFT holds one ``lora_A`` of ``[r * E, in]`` and one ``lora_B``
of ``[out, r * E]``: expert ``e``'s ``A_e`` is rows ``e*r : (e+1)*r`` of ``lora_A``, its ``B_e`` the
columns ``e, e + E, e + 2E, ...`` of ``lora_B`` (``lora_B.view(out, r, E)[:, :, e]``), and its weight
is ``W_e + scaling * B_e @ A_e``. Each targeted tensor gets its own wrapper around the experts
module, nested in the order the module registers its tensors (``gate_up_proj`` innermost), so the
keys are PEFT's: with both targeted, ``mlp.experts.base_layer.lora_A.weight`` (gate_up) and
``mlp.experts.lora_A.weight`` (down); with one, ``mlp.experts.lora_A.weight``.

The forward does not form ``W_e + delta``: the factors go to :class:`~nxd_finetune.models.moe.Experts`,
which adds the low-rank path per token group with grouped GEMMs (equal to PEFT's folded weight up
to float rounding). PEFT refuses ``lora_dropout`` on parameters; so does :class:`LoraConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora.config import LoraConfig
from nxd_finetune.lora.layers import LoraLinear, init_lora_factors
from nxd_finetune.models.moe import Experts, LowRank
from nxd_finetune.parallel.placement import AxisPlacement, Placement, Shard


class ExpertLora(LoraLinear):
    """PEFT's ``ParamWrapper`` on the fused expert tensor ``parameter_name`` of the
    :class:`Experts` inside ``base`` (``base`` is the experts module or another wrapper)."""

    def __init__(self, base: nn.Module, parameter_name: str, r: int, lora_alpha: float,
                 use_rslora: bool = False, init_lora_weights: str = "default") -> None:
        nn.Module.__init__(self)
        self.base_layer = base
        self.parameter_name = parameter_name
        weight = self.weight
        weight.requires_grad_(False)
        e, out_f, in_f = weight.shape  # the experts this rank holds (all of them without expert parallel)
        self.num_experts, self.in_features, self.out_features = e, in_f, out_f
        self.r = r
        self.lora_alpha = lora_alpha
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout = nn.Identity()
        device = torch.device("cpu") if weight.device.type == "meta" else weight.device
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        every = self.experts.num_experts  # the factors of every expert first: the same draws as in one process
        self.lora_A = nn.Linear(in_f, r * every, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(r * every, out_f, bias=False, device=device, dtype=dtype)
        self.merged = False
        self.reset_lora_parameters(init_lora_weights)
        placement = getattr(self.experts, "placements", {}).get(parameter_name)
        if placement is not None and placement.sharded:  # expert parallel: this rank's experts' factors
            for linear, spec in zip((self.lora_A, self.lora_B), expert_factor_placements(placement, r), strict=True):
                linear.weight = nn.Parameter(spec.take(linear.weight.detach()).clone())
                linear.out_features, linear.in_features = spec.local_shape
                linear.placements = {"weight": spec}  # type: ignore[assignment]  # as lora/sharded.py's

    @torch.no_grad()
    def reset_lora_parameters(self, init_lora_weights: str = "default") -> None:
        """PEFT's init of the factors of every expert (the same draws on every rank, and as in one
        process), then this rank's experts' slices kept (all of them without expert parallel)."""
        a, b = self.lora_A.weight, self.lora_B.weight
        spec_a = getattr(self.lora_A, "placements", {}).get("weight", Placement(tuple(a.shape)))
        spec_b = getattr(self.lora_B, "placements", {}).get("weight", Placement(tuple(b.shape)))
        full_a, full_b = a.new_empty(spec_a.full_shape), b.new_empty(spec_b.full_shape)
        init_lora_factors(full_a, full_b, self.r, init_lora_weights)
        a.copy_(spec_a.take(full_a))
        b.copy_(spec_b.take(full_b))

    @property
    def experts(self) -> Experts:
        """The experts module this wrapper (and any inside it) adapts."""
        return next(m for m in self.base_layer.modules() if isinstance(m, Experts))

    @property
    def weight(self) -> torch.Tensor:
        """The fused expert tensor ``[E, out, in]`` (merged or not, as ``merged`` says)."""
        weight = getattr(self.experts, self.parameter_name)
        assert isinstance(weight, torch.Tensor)
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        return None

    def factors(self) -> LowRank:
        """(``A [E, r, in]``, ``B [E, out, r]``, scaling): views of PEFT's flat factors."""
        e = self.num_experts
        a = self.lora_A.weight.view(e, self.r, self.in_features)
        b = self.lora_B.weight.view(self.out_features, self.r, e).permute(2, 0, 1).contiguous()
        return a, b, self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B_e @ A_e`` per expert in fp32, ``[E, out, in]`` (PEFT's ``get_delta_weight``)."""
        a, b, scaling = self.factors()
        return torch.bmm(b.float(), a.float()) * scaling

    @torch.no_grad()
    def merge(self) -> None:
        if not self.merged:
            self.weight.data = self.merged_weight()
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.weight.data = self.unmerged_weight()
            self.merged = False

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,  # type: ignore[override]
                lora: Mapping[str, LowRank] | None = None) -> torch.Tensor:
        """The experts' forward with this tensor's factors added to ``lora`` (none once merged)."""
        deltas = dict(lora or {})
        if not self.merged:
            deltas[self.parameter_name] = self.factors()
        out = self.base_layer(x, index, weights, deltas)
        assert isinstance(out, torch.Tensor)
        return out

    def extra_repr(self) -> str:
        return f"parameter_name={self.parameter_name!r}, experts={self.num_experts}, {super().extra_repr()}"


def expert_factor_placements(weight: Placement, r: int) -> tuple[Placement, Placement]:
    """PEFT's ``lora_A [r * E, in]`` and ``lora_B [out, r * E]`` placed after the fused tensor
    ``weight [E, out, in]``: split on experts (expert parallel) ``lora_A``'s rows ``e*r : (e+1)*r``
    go with expert ``e`` (a contiguous block per rank) and ``lora_B``'s columns ``e, e + E, ...``
    (each of its ``r`` runs of ``E`` columns split alike: ``Shard.parts``); other axes as the weight."""
    e, out_f, in_f = weight.full_shape
    on_a: list[tuple[str, AxisPlacement]] = []
    on_b: list[tuple[str, AxisPlacement]] = []
    for axis, p in weight.on:
        if isinstance(p, Shard):
            if p.dim != 0:
                raise AdapterError(f"LoRA on experts split on dim {p.dim} over {axis}: only a split by expert "
                                   "is supported")
            on_a.append((axis, Shard(0, p.pieces, p.index)))
            on_b.append((axis, Shard(1, p.pieces, p.index, parts=(e,) * r)))
        else:
            on_a.append((axis, p))
            on_b.append((axis, p))
    return Placement((r * e, in_f), tuple(on_a)), Placement((out_f, r * e), tuple(on_b))


def expert_parameters(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(module name, parameter name, full name)`` of every fused expert tensor, in module and
    registration order (``gate_up_proj`` before ``down_proj``, as PEFT nests its wrappers)."""
    return [(name, p, f"{name}.{p}") for name, m in model.named_modules() if isinstance(m, Experts)
            for p, _ in m.named_parameters(recurse=False)]


def find_expert_targets(model: nn.Module, cfg: LoraConfig) -> list[tuple[str, str]]:
    """``(experts module name, parameter name)`` that ``cfg.target_parameters`` selects, matched as
    PEFT does (the full parameter name equals an entry or ends with ``"." + entry``). Raises
    AdapterError (one line) for an entry that matches no expert tensor or names another parameter."""
    if not cfg.target_parameters:
        return []
    experts = expert_parameters(model)
    if not experts:
        raise AdapterError("lora.target_parameters puts LoRA on the fused expert tensors of a mixture-of-experts "
                           "model; this model has none (use target_modules)")
    known = sorted({full.split(".experts.")[0].rpartition(".")[2] + ".experts." + p for _, p, full in experts})
    for entry in cfg.target_parameters:
        if not any(full == entry or full.endswith("." + entry) for _, _, full in experts):
            other = next((n for n, _ in model.named_parameters() if n == entry or n.endswith("." + entry)), None)
            what = f"names {other}, which is not an expert tensor" if other else "matches no expert tensor"
            raise AdapterError(f"lora.target_parameters entry {entry!r} {what}; expert tensors: {', '.join(known)}")
    return [(module, p) for module, p, full in experts
            if any(full == e or full.endswith("." + e) for e in cfg.target_parameters)]


def wrap_experts(model: nn.Module, module: str, parameter_name: str, cfg: LoraConfig) -> None:
    """Wrap ``module`` (the experts, or a wrapper already around them) with :class:`ExpertLora`."""
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    wrapped = ExpertLora(model.get_submodule(module), parameter_name, r=cfg.r, lora_alpha=cfg.lora_alpha,
                         use_rslora=cfg.use_rslora, init_lora_weights=cfg.init_lora_weights)
    setattr(parent, child, wrapped)

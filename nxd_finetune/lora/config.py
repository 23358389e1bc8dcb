"""LoRA hyper-parameters with PEFT's semantics, and their ``adapter_config.json`` form.

``LoraConfig`` mirrors the subset of ``peft.LoraConfig`` this project implements. Everything a user
can get wrong raises :class:`~nxd_finetune.errors.AdapterError` with a one-line message, both when
the config is built from a recipe and when it is read from an adapter someone else wrote.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Any

from nxd_finetune.errors import AdapterError
from nxd_finetune.jsontypes import JsonObject, JsonValue

if TYPE_CHECKING:
    from nxd_finetune.recipe import LoraSection

ALL_LINEAR = "all-linear"
BIAS_MODES = ("none", "all", "lora_only")
INIT_MODES = ("default", "gaussian")

# Keys every PEFT release since 0.10 knows, with PEFT's defaults. We write only these (plus the
# fields of LoraConfig): newer PEFT fills its newer keys with the same defaults when they are
# absent, while older PEFT releases reject keys they do not know.
PEFT_DEFAULTS: JsonObject = {
    "alpha_pattern": {},
    "auto_mapping": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "rank_pattern": {},
    "use_dora": False,
}

# PEFT keys whose non-default values change the maths of the adapter; we refuse such adapters
# rather than load them wrongly. Value: the default (anything "falsy" counts as default).
_UNSUPPORTED_KEYS = (
    "lora_bias",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "layer_replication",
    "exclude_modules",
    "trainable_token_indices",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "arrow_config",
    "velora_config",
    "monteclora_config",
    "kasa_config",
    "ensure_weight_tying",
)


@dataclasses.dataclass
class LoraConfig:
    """LoRA settings, PEFT semantics.

    - ``r``: rank (positive int). ``lora_alpha``: scale numerator (> 0).
    - ``scaling`` = ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
    - ``lora_dropout``: dropout on the LoRA input only, in [0, 1).
    - ``bias``: ``none`` (biases frozen, not saved), ``all`` (every ``*.bias`` of the model trained
      and saved), ``lora_only`` (only the biases of LoRA-wrapped layers trained and saved).
    - ``target_modules``: a list of names, each matching a module whose full name equals it or ends
      with ``"." + name`` (``q_proj`` or ``self_attn.q_proj``); or a regex string matched with
      ``re.fullmatch`` against the full module name; or ``"all-linear"`` (every linear layer
      except ``lm_head``).
    - ``init_lora_weights``: ``default`` (A kaiming-uniform with a=sqrt(5), B zero) or
      ``gaussian`` (A ~ N(0, std=1/r), B zero), as PEFT.
    - ``modules_to_save``: module names (suffix match, like ``target_modules`` lists) that are
      copied and trained in full; saved under the module's own keys, as PEFT does.
    - ``target_parameters``: fused expert tensors of a mixture-of-experts model
      (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``; suffix match on the parameter's
      name), LoRA'd per expert as PEFT's ``target_parameters`` (:mod:`nxd_finetune.lora.experts`);
      ``target_modules`` may then be empty. No dropout with it (PEFT refuses it too).
    - ``use_dora``: DoRA (:mod:`nxd_finetune.lora.dora`): a trained magnitude per output feature
      of every LoRA'd linear, PEFT's ``lora_magnitude_vector``. Not with ``target_parameters``
      (PEFT refuses it too).
    """

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    bias: str = "none"
    target_modules: list[str] | str = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    use_rslora: bool = False
    init_lora_weights: str = "default"
    modules_to_save: list[str] = dataclasses.field(default_factory=list)
    target_parameters: list[str] = dataclasses.field(default_factory=list)
    use_dora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise AdapterError(f"lora rank r must be a positive integer, got {self.r!r}")
        if (
            isinstance(self.lora_alpha, bool)
            or not isinstance(self.lora_alpha, (int, float))
            or not math.isfinite(self.lora_alpha)
            or self.lora_alpha <= 0
        ):
            raise AdapterError(f"lora_alpha must be a positive number, got {self.lora_alpha!r}")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise AdapterError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if self.bias not in BIAS_MODES:
            raise AdapterError(f"unknown LoRA bias {self.bias!r}; use one of {', '.join(BIAS_MODES)}")
        if self.init_lora_weights not in INIT_MODES:
            raise AdapterError(
                f"unknown init_lora_weights {self.init_lora_weights!r}; use one of {', '.join(INIT_MODES)}"
            )
        self.target_parameters = _check_parameters(self.target_parameters)
        empty_ok = bool(self.target_parameters) and self.target_modules in ([], None)
        self.target_modules = [] if empty_ok else _check_targets(self.target_modules)
        if self.target_parameters and self.lora_dropout:
            raise AdapterError(f"lora_dropout must be 0 with target_parameters, got {self.lora_dropout!r} "
                               "(PEFT's LoRA on expert tensors has no dropout)")
        if not isinstance(self.use_dora, bool):
            raise AdapterError(f"use_dora must be true or false, got {self.use_dora!r}")
        if self.use_dora and self.target_parameters:
            raise AdapterError("use_dora does not work with target_parameters (PEFT has no DoRA for expert tensors)")
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [self.modules_to_save]
        if not isinstance(self.modules_to_save, (list, tuple, type(None))):
            raise AdapterError(f"modules_to_save must be a list of module names, got {self.modules_to_save!r}")
        self.modules_to_save = list(self.modules_to_save or [])
        if not all(isinstance(m, str) and m for m in self.modules_to_save):
            raise AdapterError(f"modules_to_save must be a list of module names, got {self.modules_to_save!r}")

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_section(cls, lora: LoraSection) -> LoraConfig:
        """The recipe's ``lora`` section as a config: the one conversion (recipe names -> PEFT's)."""
        return cls(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias=lora.bias,
                   target_modules=lora.target_modules, use_rslora=lora.use_rslora,
                   init_lora_weights=lora.init_lora_weights, modules_to_save=list(lora.modules_to_save),
                   target_parameters=list(lora.target_parameters), use_dora=lora.use_dora)

    def to_section(self, **extra: JsonValue) -> JsonObject:
        """This config as a recipe ``lora`` section (a dict; ``extra``: e.g. ``init_from``)."""
        return {"rank": self.r, "alpha": self.lora_alpha, "dropout": self.lora_dropout, "bias": self.bias,
                "target_modules": self._targets(), "use_rslora": self.use_rslora,
                "init_lora_weights": self.init_lora_weights, "modules_to_save": list(self.modules_to_save),
                **({"target_parameters": list(self.target_parameters)} if self.target_parameters else {}),
                **({"use_dora": True} if self.use_dora else {}), **extra}

    def to_peft_dict(self, base_model_name_or_path: str | None, revision: str | None = None) -> JsonObject:
        """The ``adapter_config.json`` dict that PEFT writes for this config, and nothing else (PEFT
        warns about keys it does not know).

        ``init_lora_weights`` is written as PEFT's value (``True`` for default).
        ``"all-linear"`` stays as is here; :func:`~nxd_finetune.lora.io.save_adapter` replaces it
        with the resolved module names, as PEFT does.
        """
        alpha = int(self.lora_alpha) if float(self.lora_alpha).is_integer() else self.lora_alpha
        d: JsonObject = dict(PEFT_DEFAULTS)
        d.update(
            peft_type="LORA",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model_name_or_path,
            revision=revision,
            r=self.r,
            lora_alpha=alpha,
            lora_dropout=float(self.lora_dropout),
            bias=self.bias,
            target_modules=self._targets(),
            use_rslora=self.use_rslora,
            init_lora_weights=True if self.init_lora_weights == "default" else self.init_lora_weights,
            modules_to_save=list(self.modules_to_save) or None,
            use_dora=self.use_dora,
        )
        if self.target_parameters:  # PEFT >= 0.17's key; left out otherwise, as older PEFT rejects it
            d["target_parameters"] = list(self.target_parameters)
        return d

    def _targets(self) -> JsonValue:
        """``target_modules`` as JSON (a list copied)."""
        return list(self.target_modules) if isinstance(self.target_modules, list) else self.target_modules

    @classmethod
    def from_peft_dict(cls, d: object) -> LoraConfig:
        """Read an ``adapter_config.json`` dict written by PEFT or by us.

        Raises AdapterError for a non-LoRA adapter, a task other than causal LM, or a PEFT feature
        that changes the adapter's maths and that we do not implement (rank patterns, ...).
        """
        if not isinstance(d, dict):
            raise AdapterError("adapter_config.json does not hold a JSON object")
        if d.get("peft_type") != "LORA":
            raise AdapterError(f"adapter peft_type is {d.get('peft_type')!r}; only LORA is supported")
        if d.get("task_type") not in (None, "CAUSAL_LM"):
            raise AdapterError(f"adapter task_type is {d['task_type']!r}; only CAUSAL_LM is supported")
        for key in _UNSUPPORTED_KEYS:
            if d.get(key):
                raise AdapterError(f"adapter uses {key}={d[key]!r}, which nxd-finetune does not support")
        init = d.get("init_lora_weights", True)
        if init is True or init is False:
            init = "default"  # the saved tensors replace the initial values either way
        elif init not in INIT_MODES:
            raise AdapterError(f"adapter init_lora_weights={init!r} is not supported (it changes the base weights)")
        parameters = d.get("target_parameters") or []
        if d.get("target_modules") in (None, [], "") and not parameters:
            raise AdapterError("adapter_config.json has no target_modules")
        for key in ("r", "lora_alpha"):
            if key not in d:
                raise AdapterError(f"adapter_config.json has no {key!r}")
        return cls(
            r=d["r"],
            lora_alpha=d["lora_alpha"],
            lora_dropout=d.get("lora_dropout", 0.0) or 0.0,
            bias=d.get("bias", "none"),
            target_modules=d.get("target_modules") or [],
            use_rslora=bool(d.get("use_rslora", False)),
            init_lora_weights=init,
            modules_to_save=d.get("modules_to_save") or [],
            target_parameters=parameters,
            use_dora=bool(d.get("use_dora") or False),
        )


def _check_parameters(names: object) -> list[str]:
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise AdapterError(f"lora target_parameters must be a list of parameter names, got {names!r}")
    return list(names)


def _check_targets(targets: Any) -> list[str] | str:
    if isinstance(targets, str):
        if not targets:
            raise AdapterError("lora target_modules is empty")
        if targets.lower() == ALL_LINEAR:
            return ALL_LINEAR
        try:
            re.compile(targets)
        except re.error as e:
            raise AdapterError(f"lora target_modules {targets!r} is not a valid regex: {e}") from None
        return targets
    if isinstance(targets, (list, tuple, set)):
        names = sorted(targets) if isinstance(targets, set) else list(targets)
        if not names:
            raise AdapterError("lora target_modules is empty")
        if not all(isinstance(n, str) and n for n in names):
            raise AdapterError(f"lora target_modules must be module names, got {names!r}")
        return names
    raise AdapterError(f"lora target_modules must be a list of names or a regex string, got {targets!r}")

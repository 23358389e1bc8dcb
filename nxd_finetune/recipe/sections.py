"""The recipe's sections: one pydantic model per YAML section (``extra="forbid"``) and
:class:`Recipe`, the whole tree. Validators hold the rules within a section and across sections
(``nproc`` divisible by ``tp*pp``, batch sizes, sequence parallel and ``max_seq_len``, ...); every
failure is a ``ValueError`` whose text becomes the one-line :class:`RecipeError`."""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nxd_finetune.data.formats import OPTIONAL_FIELDS, REQUIRED_FIELDS, TemplateValue, template_kwargs_problem
from nxd_finetune.errors import NxdError, NxdWarning, RecipeError
from nxd_finetune.neuron_presets import resolve_preset
from nxd_finetune.recipe.messages import suggest
from nxd_finetune.recipe.preference import PreferenceSection, check_objective, known_objective
from nxd_finetune.rl.section import RLSection

_NAME = re.compile(r"[a-z][a-z0-9_]*")  # a device type / torch.compile backend name

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
StrList = list[str]
# a recipe as plain data (the YAML / JSON document): what Recipe.to_dict returns, recipe_from_dict reads
RecipeDict = dict[str, Any]

# data.format -> its canonical fields (data.fields maps them to column names); owned by data.formats
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    fmt: REQUIRED_FIELDS[fmt] + OPTIONAL_FIELDS.get(fmt, ()) for fmt in REQUIRED_FIELDS
}


class _Section(BaseModel):
    # no recipe number means anything as inf or nan (training.lr=.inf trained NaN until a save failed)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class QuantizationSection(_Section):
    """``model.quantization``: a frozen base quantized by bitsandbytes under LoRA (QLoRA), in
    bitsandbytes' and peft's names: ``method`` nf4 / fp4 (4-bit) or int8 (LLM.int8()); for 4-bit
    ``double_quant`` (``bnb_4bit_use_double_quant``), ``compute_dtype`` (``bnb_4bit_compute_dtype``)
    and ``block_size`` (transformers' loader always uses 64). Defaults: ``BitsAndBytesConfig``'s.
    ``embeddings``: the input embedding and output layer (tied or not) in 4 bits too (transformers
    keeps them in ``model.dtype``); nf4 / fp4 only, not with LoRA or ``modules_to_save`` on them."""

    method: Literal["nf4", "fp4", "int8"]
    double_quant: bool = False
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    block_size: Literal[32, 64, 128, 256, 512, 1024, 2048, 4096] = 64
    embeddings: bool = False

    @model_validator(mode="after")
    def _check(self) -> QuantizationSection:
        # set to other than their defaults: the recipe's dict (to_dict, what workers and resume read) holds them all
        four_bit_only = sorted(name for name in {"double_quant", "compute_dtype", "block_size"} & self.model_fields_set
                               if getattr(self, name) != type(self).model_fields[name].default)
        if self.method == "int8" and four_bit_only:
            raise ValueError(f"model.quantization.{four_bit_only[0]} applies to the 4-bit methods (nf4, fp4); "
                             "int8 quantizes each weight row and computes in the input's dtype")
        if self.method == "int8" and self.embeddings:
            raise ValueError("model.quantization.embeddings needs a 4-bit method (nf4 or fp4), not int8")
        return self


class ModelSection(_Section):
    """``path``: HF model directory (config.json + safetensors) or ``builtin:tiny-llama``.
    ``dtype``: the dtype the base weights are loaded in. ``tokenizer``: defaults to ``path``.
    ``attention``: the attention kernels (``nxd_finetune.models.flex.ATTENTIONS``: ``auto`` is
    FlexAttention on CUDA for packed rows, windows and soft-capped scores, SDPA otherwise).
    ``compile``: ``torch.compile`` each decoder layer's work around the attention kernel (norms,
    projections with their LoRA, rope, MLP) with a torch.compile backend: ``true`` / ``inductor``
    (torch's, for cpu and cuda), ``neuron`` (TorchNeuron's), any backend torch._dynamo has; the
    first steps then take the compile time.
    ``quantization``: the frozen base in 4 or 8 bits under LoRA (QLoRA, docs/qlora.md)."""

    path: str = Field(min_length=1)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    compile: bool | str = False
    revision: str | None = None
    tokenizer: str | None = None
    quantization: QuantizationSection | None = None

    @field_validator("compile")
    @classmethod
    def _compile_backend(cls, value: bool | str) -> bool | str:
        if isinstance(value, str) and not _NAME.fullmatch(value):
            raise ValueError(f"model.compile={value!r} is not a torch.compile backend name: use true (inductor), "
                             "false, or a backend's name (inductor, neuron)")
        return value


class DataSection(_Section):
    """``train``/``eval``: one file or a list. Without ``eval``, ``eval_fraction`` of train is held
    out. ``fields`` maps the format's canonical fields (:data:`FORMAT_FIELDS`) to column names.
    ``chat_template_kwargs``: variables every chat-template render sees (TRL's name; Qwen3's
    ``enable_thinking: false``); ``{}`` is stored as null."""

    train: str | StrList
    eval: str | StrList | None = None
    eval_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    format: Literal["messages", "alpaca", "prompt_completion", "text", "preference", "prompt"] = "messages"
    fields: dict[str, str] = {}
    chat_template: str | None = None
    chat_template_kwargs: dict[str, TemplateValue] | None = None
    max_seq_len: int = Field(default=512, ge=2)
    packing: bool = True
    train_on_prompt: bool = False
    cache_dir: str | None = None
    shuffle: bool = True
    max_samples: PosInt | None = None
    num_proc: PosInt | Literal["auto"] = "auto"  # tokenizing processes (auto: a core each, large sets)

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, value: object) -> object:
        problem = template_kwargs_problem(value)
        if problem:
            raise ValueError(problem)
        return value or None

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        for key in ("train", "eval"):
            if getattr(self, key) == []:
                raise ValueError(f"data.{key} is an empty list")
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError(f"data.eval is set and data.eval_fraction={self.eval_fraction}; set only one")
        known = FORMAT_FIELDS[self.format]
        for name in self.fields:
            if name not in known:
                raise ValueError(f"data.fields.{name} is not a field of format {self.format}"
                                 f"{suggest(name, known)}; its fields: {', '.join(known)}")
        if self.format == "preference" and self.train_on_prompt:
            raise ValueError("data.train_on_prompt does not apply to format preference (pairs are scored on their "
                             "completions, as TRL does)")
        return self


class LoraSection(_Section):
    """LoRA hyper-parameters (PEFT semantics). ``target_modules``: module names, a regex string or
    ``"all-linear"``. ``target_parameters``: a mixture-of-experts model's fused expert tensors
    (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), PEFT's name; ``target_modules`` may
    then be ``[]``. ``init_from``: an adapter to start from (directory, registry REF or
    ``s3://`` prefix); it must have been trained on this base unless ``allow_other_base``.
    ``use_dora``: DoRA (PEFT's ``use_dora``: a trained magnitude per output feature)."""

    rank: PosInt = 8
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    bias: Literal["none", "all", "lora_only"] = "none"
    target_modules: StrList | str = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    use_rslora: bool = False
    init_lora_weights: Literal["default", "gaussian"] = "default"
    modules_to_save: StrList = []
    target_parameters: StrList = []
    use_dora: bool = False
    init_from: str | None = None
    allow_other_base: bool = False

    @model_validator(mode="after")
    def _check(self) -> LoraSection:
        if self.target_modules == "" or (self.target_modules == [] and not self.target_parameters):
            raise ValueError("lora.target_modules is empty")
        if self.target_parameters and self.dropout:
            raise ValueError("lora.dropout must be 0 with lora.target_parameters (PEFT's LoRA on expert tensors "
                             "has no dropout)")
        if self.use_dora and self.target_parameters:
            raise ValueError("lora.use_dora does not work with lora.target_parameters (PEFT has no DoRA for "
                             "expert tensors)")
        if self.allow_other_base and not self.init_from:
            raise ValueError("lora.allow_other_base is set but lora.init_from is not (it only concerns init_from)")
        return self


class ParallelSection(_Section):
    """Process layout: ``nproc = tp * pp * dp``. ``pp_cuts``: the first layer index of every
    pipeline stage after the first (``pp * virtual_stages - 1`` numbers); None splits evenly.
    ``ep``: expert parallel (mixture-of-experts models), carved out of dp: each group of ``ep`` dp
    ranks splits the experts between them (``ep`` divides dp and the expert count).
    ``max_restarts``: how often ``nxd-finetune run`` restarts its workers after one failed (torch
    elastic; the run resumes from the newest complete checkpoint). ``activation_checkpointing``
    left out with ``model.quantization`` set resolves to ``full`` (as peft's
    ``prepare_model_for_kbit_training`` turns gradient checkpointing on); an explicit value stays."""

    nproc: PosInt = 1
    tp: PosInt = 1
    pp: PosInt = 1
    ep: PosInt = 1
    virtual_stages: PosInt = 1
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    pp_cuts: list[PosInt] | None = None
    zero1: bool = False
    sequence_parallel: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    checkpoint_modules: StrList = []
    max_restarts: NonNegInt = 0

    @property
    def dp(self) -> int:
        """Data-parallel degree, ``nproc // (tp * pp)``."""
        return self.nproc // (self.tp * self.pp)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @model_validator(mode="after")
    def _check(self) -> ParallelSection:
        tp, pp, vs = self.tp, self.pp, self.virtual_stages
        if self.nproc % (tp * pp):
            raise ValueError(f"parallel.nproc={self.nproc} is not divisible by tp*pp={tp}*{pp}={tp * pp}")
        if vs > 1 and pp == 1:
            raise ValueError(f"parallel.virtual_stages={vs} needs parallel.pp > 1 (pp=1)")
        if self.dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} does not divide the data-parallel degree dp={self.dp} "
                             f"(nproc/(tp*pp) = {self.nproc}/({tp}*{pp})): expert-parallel ranks are carved out of dp")
        if vs > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ValueError(f"parallel.virtual_stages={vs} needs parallel.pp_schedule=interleaved_1f1b "
                             f"(got {self.pp_schedule})")
        if self.sequence_parallel and tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1 (tp=1)")
        if self.pp_cuts is not None:
            cuts, stages = self.pp_cuts, self.num_stages
            if len(cuts) != stages - 1:
                raise ValueError(f"parallel.pp_cuts has {len(cuts)} entries; pp*virtual_stages={pp}*{vs}="
                                 f"{stages} stages need {stages - 1}")
            if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
                raise ValueError(f"parallel.pp_cuts={cuts} must be strictly increasing")
        if self.checkpoint_modules and self.activation_checkpointing == "none":
            raise ValueError("parallel.checkpoint_modules is set but parallel.activation_checkpointing=none")
        return self


class TrainingSection(_Section):
    """Optimisation. Exactly one of ``max_steps`` / ``epochs`` (neither -> ``epochs=1``). Batch:
    ``global_batch_size = micro_batch_size * grad_accum * dp``; give either of the last two."""

    micro_batch_size: PosInt = 1
    global_batch_size: PosInt | None = None
    grad_accum: PosInt | None = None
    max_steps: PosInt | None = None
    epochs: float | None = Field(default=None, gt=0)
    lr: float = Field(default=2e-4, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: NonNegInt = 0
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    seed: NonNegInt = 42
    precision: Literal["fp32", "bf16", "bf16-mixed"] = "fp32"
    # auto, cpu, cuda, xla or a device backend torch has (TorchNeuron's neuron: nxd_finetune.device)
    device: str = "auto"
    # rows of logits computed at once by the chunked loss ("auto": 256 MB of fp32 logits; null: all)
    loss_chunk_tokens: PosInt | Literal["auto"] | None = "auto"

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"training.device={value!r} is not a device name: use auto, cpu, cuda, xla or a device "
                             "backend's name (neuron)")
        return value

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError(f"training.max_steps={self.max_steps} and training.epochs={self.epochs} "
                             "are both set; set only one")
        if self.max_steps is None and self.epochs is None:
            self.epochs = 1.0
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            # as other trainers: a short trial run needs no second override
            warnings.warn(f"training.warmup_steps={self.warmup_steps} exceeds training.max_steps="
                          f"{self.max_steps}: warmup clamped to {self.max_steps} step(s)", NxdWarning, stacklevel=2)
            self.warmup_steps = self.max_steps
        return self

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each data-parallel rank.

        Raises RecipeError when ``global_batch_size`` is not a multiple of ``micro_batch_size * dp``
        or disagrees with an explicit ``grad_accum``.
        """
        micro, accum, total = self.micro_batch_size, self.grad_accum, self.global_batch_size
        if total is None:
            return accum or 1
        per_step = micro * dp
        if total % per_step:
            raise RecipeError(f"training.global_batch_size={total} is not divisible by "
                              f"micro_batch_size*dp={micro}*{dp}={per_step}")
        if accum is not None and accum != total // per_step:
            raise RecipeError(f"training.global_batch_size={total} disagrees with micro_batch_size*grad_accum*dp="
                              f"{micro}*{accum}*{dp}={micro * accum * dp}; set only one of the two")
        return total // per_step

    def global_batch(self, dp: int) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.micro_batch_size * self.grad_accum_steps(dp) * dp


class EvalSection(_Section):
    """``prompts``: user messages generated from (greedy, ``max_new_tokens``) at every eval and
    logged beside the scores (:mod:`nxd_finetune.serve.samples`)."""

    every_n_steps: PosInt | None = None
    max_batches: PosInt | None = None
    before: bool = True  # evaluate once before the first step (the summary's "eval before")
    prompts: StrList = []
    max_new_tokens: PosInt = 32


class CheckpointSection(_Section):
    """``dir`` None -> ``<output.dir>/checkpoints`` (a local path or ``s3://bucket/prefix``).
    Training state is saved every ``every_n_steps`` (None: only at the end and on SIGTERM/SIGINT);
    the ``keep_last`` newest complete checkpoints are kept. ``async_save`` writes in a background
    thread. ``resume``: ``latest`` (the default: the newest complete checkpoint of ``dir``, or a
    fresh start when there is none), a checkpoint path, or None (start fresh, removing earlier
    checkpoints of ``dir``); the CLI's ``--resume``/``--no-resume`` set it. ``save_mode`` applies
    to LoRA runs' final artefact; full SFT always saves the whole model."""

    dir: str | None = None
    every_n_steps: PosInt | None = None
    keep_last: PosInt = 2
    async_save: bool = False
    save_mode: Literal["adapter", "base_and_adapter", "merged"] = "adapter"
    resume: str | None = "latest"


class OutputSection(_Section):
    dir: str = "outputs/run"
    registry: str | None = None


class MlflowSection(_Section):
    """``tracking_uri``: an MLflow URI (``http://...``, ``sqlite:///...``, ``databricks``), or a
    directory for a local store (``<dir>/mlflow.db`` + ``<dir>/artifacts``; default ``mlruns``)."""

    tracking_uri: str = "mlruns"
    experiment: str = "nxd-finetune"
    run_name: str | None = None


class WandbSection(_Section):
    """``dir``: where W&B writes its files (default ``<output.dir>``)."""

    project: str = "nxd-finetune"
    entity: str | None = None
    name: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    dir: str | None = None


class LoggingSection(_Section):
    """``mlflow`` / ``wandb``: follow the run there too (:mod:`nxd_finetune.trackers`); ``{}`` for defaults."""

    every_n_steps: PosInt = 1
    tensorboard: bool = False
    progress: bool = True
    mlflow: MlflowSection | None = None
    wandb: WandbSection | None = None


class NeuronSection(_Section):
    """Trainium settings, applied only when ``torch_neuronx`` imports and the run is on xla
    (:func:`nxd_finetune.neuron.neuron_env`). ``compile_cache``: the compiler cache root
    (``--cache_dir``; None keeps Neuron's default, /var/tmp/neuron-compile-cache). ``precision``:
    a preset (``auto`` derives it from ``training.precision`` and ``parallel.zero1``).
    ``stochastic_rounding``: None keeps the preset's choice. ``cc_flags``: more compiler flags."""

    compile_cache: str | None = None
    model_type: str | None = Field(default="transformer", min_length=1)
    precision: Literal["auto", "fp32", "bf16-sr", "bf16-master", "autocast"] = "auto"
    stochastic_rounding: bool | None = None
    cc_flags: StrList = []


class Recipe(_Section):
    """A validated recipe. ``lora`` None means full fine-tuning. ``objective``: ``sft`` (default),
    preference tuning (``dpo``, ``orpo``) with its ``preference`` section, or online RL (``grpo``)
    with its ``rl`` section: a name in the objective registry (:mod:`nxd_finetune.objectives`)."""

    model: ModelSection
    data: DataSection
    objective: str = "sft"
    preference: PreferenceSection | None = None
    rl: RLSection | None = None
    lora: LoraSection | None = None
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    output: OutputSection = Field(default_factory=OutputSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    neuron: NeuronSection = Field(default_factory=NeuronSection)

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, name: str) -> str:
        return known_objective(name)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        try:
            resolve_preset(self.training.precision, self.parallel.zero1, self.neuron.precision)
        except NxdError as e:
            raise ValueError(str(e)) from None
        try:
            self.training.grad_accum_steps(self.parallel.dp)
        except RecipeError as e:
            raise ValueError(str(e)) from None
        tp, seq = self.parallel.tp, self.data.max_seq_len
        if self.parallel.sequence_parallel and seq % tp:
            raise ValueError(f"data.max_seq_len={seq} is not divisible by parallel.tp={tp} "
                             "(sequence_parallel splits the sequence over tp ranks)")
        if self.eval.every_n_steps and self.data.eval is None and self.data.eval_fraction == 0:
            raise ValueError(f"eval.every_n_steps={self.eval.every_n_steps} but there is no eval data; "
                             "set data.eval or data.eval_fraction")
        if self.model.quantization is not None and self.lora is None:
            raise ValueError(f"model.quantization={self.model.quantization.method} needs a lora section: a quantized "
                             "base is frozen (QLoRA); full fine-tuning of a quantized base is not supported")
        quant = self.model.quantization
        if quant is not None and "activation_checkpointing" not in self.parallel.model_fields_set:
            # a quantized base recomputes by default, as peft's prepare_model_for_kbit_training does;
            # still not among the fields the recipe set (validate calls it the default)
            self.parallel.activation_checkpointing = "full"
            self.parallel.model_fields_set.discard("activation_checkpointing")
        if quant is not None and quant.method == "int8" and self.lora is not None and self.lora.use_dora:
            raise ValueError("lora.use_dora with model.quantization.method=int8 is not supported (peft's DoRA does "
                             "not train on an 8-bit base); use nf4 or fp4")
        if quant is not None and quant.embeddings and self.lora is not None:
            named = [*self.lora.modules_to_save, *([] if isinstance(self.lora.target_modules, str)
                                                   else self.lora.target_modules)]
            adapted = [n for n in named if n.split(".")[-1] in ("embed_tokens", "lm_head")]
            if adapted:
                raise ValueError(f"lora on {adapted[0]} with model.quantization.embeddings is not supported: the "
                                 "quantized embedding and output layer are frozen; leave it out or set embeddings "
                                 "false")
        wrong = check_objective(self.objective, {"preference": self.preference, "rl": self.rl}, self.data.format,
                                self.lora.init_from if self.lora else None, full=self.lora is None)
        if wrong:
            raise ValueError(wrong)
        return self

    @property
    def grad_accum_steps(self) -> int:
        """``training.grad_accum_steps(parallel.dp)``."""
        return self.training.grad_accum_steps(self.parallel.dp)

    def to_dict(self) -> RecipeDict:
        """Plain dict (lists, no tuples) that :func:`recipe_from_dict` turns back into this recipe."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

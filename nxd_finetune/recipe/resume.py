"""What a resumed run may change in its recipe.

A checkpoint carries the recipe it was saved under. Resuming compares it with the recipe of the
new command, key by key (dotted paths of :meth:`Recipe.to_dict`):

- keys that fix *what is trained* (the model, the LoRA shape, the training data and how it is cut
  into rows, the seed, the precision, the global batch) cannot change: :func:`check_resume`
  raises :class:`RecipeError` naming the first such key, before any tensor is read;
- keys read only when a run starts fresh (``lora.init_from``, ``lora.init_lora_weights``,
  ``eval.before``...) are ignored on resume, and said to be (a preference run keeps the reference
  log-probs it started with, which its checkpoint records: ``sft.reference.attach_reference``);
- every other key (``training.lr``, the schedule, ``max_steps``, logging, eval, checkpointing,
  the parallel layout, since checkpoints reshard) is applied from the resumed step.

The caller prints :func:`describe_changes`: one line, so a changed recipe is never silently
ignored nor silently applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import yaml

from nxd_finetune.errors import RecipeError
from nxd_finetune.recipe.loading import recipe_from_dict
from nxd_finetune.recipe.sections import Recipe, RecipeDict

FIXED_KEYS: tuple[str, ...] = (
    "model", "lora.rank", "lora.alpha", "lora.bias", "lora.target_modules", "lora.use_rslora",
    "lora.modules_to_save", "lora.target_parameters", "data.train", "data.eval_fraction", "data.format", "data.fields",
    "data.chat_template", "data.chat_template_kwargs", "data.max_seq_len", "data.packing", "data.train_on_prompt",
    "data.shuffle", "data.max_samples", "training.seed", "training.precision", "training.micro_batch_size",
    "objective", "preference.max_prompt_length", "preference.truncation_mode", "preference.reference",
    "preference.precompute_ref_log_probs",
)
"""Dotted keys (or whole sections) a resumed run must keep: they decide the trained weights' shape,
the sequence of training rows the checkpoint's data position points into, what is optimized
(the objective) or the reference log-probs stored with the pairs. A preference loss setting
(``beta``, ``loss_type``...) is a hyperparameter like ``lr``: applied from the resumed step."""

APPLIED_MODEL_KEYS: tuple[str, ...] = ("model.attention", "model.compile")
"""Keys of the fixed ``model`` section that only choose how the same numbers are computed: applied
from the resumed step."""

IGNORED_KEYS: tuple[str, ...] = (
    "lora.init_from", "lora.allow_other_base", "lora.init_lora_weights", "eval.before", "checkpoint.resume",
)
"""Keys only a fresh start reads; a resumed run continues from the checkpoint's weights."""

OPTIMIZER_KEYS: tuple[str, ...] = ("training.lr", "training.betas", "training.eps", "training.weight_decay")
SCHEDULE_KEYS: tuple[str, ...] = ("training.lr", "training.scheduler", "training.warmup_steps",
                                  "training.min_lr_ratio", "training.max_steps", "training.epochs")
"""Keys whose new value the resumed optimizer / LR schedule takes from the resumed step on."""


@dataclasses.dataclass(frozen=True)
class RecipeChange:
    """One key whose value differs between the checkpoint's recipe and the new one."""

    key: str
    old: object
    new: object

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: object, limit: int = 60) -> str:
    text = repr(tuple(value) if isinstance(value, list) and len(value) == 2 else value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _flatten(data: object, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict) and data:
        out: dict[str, object] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: data}


def _matches(key: str, names: tuple[str, ...]) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def recipe_changes(saved: Mapping[str, object], current: Mapping[str, object]) -> list[RecipeChange]:
    """Every dotted key whose value differs (a key present on one side only counts as None on the
    other, so a section switched on or off is a change of its keys)."""
    old, new = _flatten(saved), _flatten(current)
    changes = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a != b and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b)):
            changes.append(RecipeChange(key, a, b))
    return changes


def _with_defaults(saved: RecipeDict) -> RecipeDict:
    """The saved recipe through today's schema: a key it predates gets the default its run had,
    so it is no change. One the schema no longer takes is compared as it was written."""
    try:
        return recipe_from_dict(saved).to_dict()
    except (RecipeError, ValueError, TypeError):
        return saved


def _global_batch(data: RecipeDict) -> int | None:
    try:
        recipe = recipe_from_dict(data)
        return recipe.training.global_batch(recipe.parallel.dp)
    except (RecipeError, ValueError, TypeError):
        return None  # a recipe of another version of the schema: the key comparison still holds


def check_resume(saved_yaml: str, recipe: Recipe, where: str, step: int) -> list[RecipeChange]:
    """Compare the recipe a checkpoint was saved under (``saved_yaml``, its ``to_yaml``) with
    ``recipe``. Returns the changes the resumed run applies or ignores (see the module docstring);
    raises RecipeError, one line naming the key, for a change it cannot take."""
    saved = yaml.safe_load(saved_yaml)
    if not isinstance(saved, dict):
        return []
    saved = _with_defaults(saved)
    current = recipe.to_dict()
    if (saved.get("lora") is None) != (current.get("lora") is None):
        kind = "full fine-tuning" if saved.get("lora") is None else "LoRA"
        raise RecipeError(f"cannot resume from {where}: it was trained with {kind} and the recipe changes "
                          "that (lora); put it back, or start fresh with --no-resume or another output.dir")
    changes = recipe_changes(saved, current)
    for c in changes:
        if _matches(c.key, FIXED_KEYS) and not _matches(c.key, APPLIED_MODEL_KEYS):
            raise RecipeError(f"cannot resume from {where}: {c.key} changed since the checkpoint "
                              f"({_show(c.old)} -> {_show(c.new)}), and it fixes what was trained; put it back, "
                              "or start fresh with --no-resume or another output.dir")
    before, after = _global_batch(saved), recipe.training.global_batch(recipe.parallel.dp)
    if before is not None and before != after:
        raise RecipeError(f"cannot resume from {where}: the global batch changed since the checkpoint "
                          f"({before} -> {after} sequences per step: micro_batch_size x grad_accum x dp), and "
                          "the data position counts in it; keep it (set training.global_batch_size), or start "
                          "fresh with --no-resume")
    max_steps = recipe.training.max_steps
    if max_steps is not None and max_steps < step:
        raise RecipeError(f"cannot resume from {where}: training.max_steps={max_steps} is below the "
                          f"checkpoint's step {step}; raise it, or start fresh with --no-resume")
    return changes


def describe_changes(changes: list[RecipeChange], step: int) -> str | None:
    """The one line a resumed run prints about its recipe changes (None when there are none)."""
    applied = [c for c in changes if not _matches(c.key, IGNORED_KEYS)]
    ignored = [c for c in changes if _matches(c.key, IGNORED_KEYS) and c.key != "checkpoint.resume"]
    parts = []
    if applied:
        parts.append(f"applied from step {step + 1}: " + ", ".join(map(str, applied)))
    if ignored:
        parts.append("ignored (only a fresh start reads them): " + ", ".join(c.key for c in ignored))
    return "recipe changed since the checkpoint; " + "; ".join(parts) if parts else None


def changed_keys(changes: list[RecipeChange], names: tuple[str, ...]) -> bool:
    """Whether any change is to one of ``names`` (dotted keys)."""
    return any(_matches(c.key, names) for c in changes)

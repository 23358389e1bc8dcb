"""The typed recipe tree: YAML file + dotted overrides -> a validated :class:`Recipe`.

Modules: :mod:`.sections` (the pydantic models and their rules), :mod:`.loading` (YAML, overrides,
relative paths), :mod:`.messages` (one-line error messages), :mod:`.checks` (rules that need the
model's shape). Import names from the package: ``from nxd_finetune.recipe import load_recipe``.

Every section is a pydantic model with ``extra="forbid"``; attribute names are the contract listed
in ``docs/architecture.md``. Everything a user can get wrong raises :class:`RecipeError` with one
line: unknown keys name their dotted path and the closest valid key, type errors name the path and
the expected value, cross-field rules carry the numbers. Checks that need the model's shape (heads
divisible by tp, layers by pp) are in :func:`check_against_model`.

Relative paths. In a recipe *file*, a relative *input* path (model, tokenizer, data, chat template,
adapter to start from) is relative to the directory of that file, so a recipe and its data can move
together; ``~`` is expanded. *Output* paths (``output.dir``, ``output.registry``, ``checkpoint.dir``,
``checkpoint.resume``) stay relative to the current directory, where the user runs the job. On the
*command line* (overrides), a relative path is relative to the current directory, like any other
CLI argument. Strings with a scheme
(``s3://...``, ``hf://...``, ``registry://...``, any ``name://``) and ``builtin:`` names are never
touched. The path-valued keys are listed in :data:`PATH_KEYS`; ``checkpoint.resume: latest`` is a
keyword and a ``data.chat_template`` holding ``{{`` or ``{%`` is an inline template, not a path.
"""

from nxd_finetune.recipe.checks import ModelShape, check_against_model
from nxd_finetune.recipe.loading import PATH_KEYS, is_uri, load_recipe, recipe_from_dict, resolve_path
from nxd_finetune.recipe.preference import PreferenceSection, reference_of
from nxd_finetune.recipe.sections import (
    FORMAT_FIELDS,
    CheckpointSection,
    DataSection,
    EvalSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    NeuronSection,
    OutputSection,
    ParallelSection,
    QuantizationSection,
    Recipe,
    RecipeDict,
    TrainingSection,
)

__all__ = [
    "FORMAT_FIELDS",
    "PATH_KEYS",
    "CheckpointSection",
    "DataSection",
    "EvalSection",
    "LoggingSection",
    "LoraSection",
    "ModelSection",
    "ModelShape",
    "NeuronSection",
    "OutputSection",
    "ParallelSection",
    "PreferenceSection",
    "QuantizationSection",
    "Recipe",
    "RecipeDict",
    "TrainingSection",
    "check_against_model",
    "is_uri",
    "load_recipe",
    "recipe_from_dict",
    "reference_of",
    "resolve_path",
]

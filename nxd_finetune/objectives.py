"""The objective registry: every objective a recipe can name, one record each.

A record (:class:`~nxd_finetune.objective.ObjectiveRecord`) says what the rest of the package needs
to know of an objective: how it is built from its recipe section, which ``data.format`` it trains
on, which reference model it uses, its own recipe rules, what an adapter records of it and how its
pairs are tokenized. The recipe's checks (``recipe/preference.py``), the run's set-up
(``sft/setup.py``), the adapter metadata (``sft/trainer.py``), the data layer
(``data/datasets.py``) and the divergence hint (``sft/step.py``) read these records; none of them
compares objective names. A new objective is its module (the :class:`~nxd_finetune.objective.Objective`
and its record) plus one entry in :data:`OBJECTIVES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nxd_finetune.objective import SFT_RECORD, Objective, ObjectiveRecord, Section
from nxd_finetune.preference import DPO, ORPO
from nxd_finetune.rl.objective import GRPO

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe

OBJECTIVES: dict[str, ObjectiveRecord] = {r.name: r for r in (SFT_RECORD, DPO, ORPO, GRPO)}


def objective_record(name: str) -> ObjectiveRecord:
    """The record of ``objective: <name>``; ValueError (one line, the names) for an unknown one."""
    if name not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]


def section_of(recipe: Recipe, record: ObjectiveRecord) -> Section:
    """The recipe section ``record`` reads (None: it reads none, or the recipe leaves it out)."""
    if record.section is None:
        return None
    section: Section = getattr(recipe, record.section)
    return section


def objective_of(recipe: Recipe) -> Objective:
    """The recipe's objective, built from its section."""
    record = objective_record(recipe.objective)
    return record.build(section_of(recipe, record))


def reference_of(objective: str, section: Section, lora_init_from: str | None) -> str | None:
    """Which reference a run of ``objective`` uses: ``base``, ``init_from``, or None (no reference)."""
    return objective_record(objective).reference(section, lora_init_from)


def run_reference(recipe: Recipe) -> str | None:
    """The reference of the recipe's run (:func:`reference_of` of its objective and sections)."""
    record = objective_record(recipe.objective)
    return record.reference(section_of(recipe, record), recipe.lora.init_from if recipe.lora else None)


def check_objective(objective: str, sections: dict[str, Section], data_format: str, lora_init_from: str | None,
                    full: bool) -> str | None:
    """The one-line error of an invalid objective / section / data combination, else None.
    ``sections``: the recipe's objective sections by name (``{"preference": ...}``); ``full``: the
    run trains the whole model (no ``lora`` section)."""
    if objective not in OBJECTIVES:
        return f"objective: expected one of {', '.join(OBJECTIVES)}, got {objective!r}"
    record = OBJECTIVES[objective]

    def wanting(key: str, value: str | None) -> str:
        return " or ".join(r.name for r in OBJECTIVES.values() if getattr(r, key) == value)

    for name, section in sections.items():
        if section is not None and record.section != name:
            return f"{name} is set but objective={objective} (set objective: {wanting('section', name)})"
    if record.data_format is None and data_format in {r.data_format for r in OBJECTIVES.values()}:
        needs = wanting("data_format", data_format)
        return f"data.format={data_format} needs objective: {needs} (objective={objective})"
    if record.data_format is not None and data_format != record.data_format:
        return f"objective={objective} needs data.format={record.data_format} (got {data_format})"
    own = sections.get(record.section) if record.section is not None else None
    return record.check(own, lora_init_from, full)

"""The recipe's objective keys: ``objective`` (a name in :data:`nxd_finetune.objectives.OBJECTIVES`)
and the ``preference`` section (:class:`~nxd_finetune.preference.PreferenceSection`, which lives with
the preference objectives), and the rules across sections (:func:`check_objective`, from each
objective's record), each failure one line."""

from __future__ import annotations

from nxd_finetune.objectives import OBJECTIVES, check_objective, objective_record, reference_of
from nxd_finetune.preference import BETA_RANGE, SIMPO_GAMMA_MAX, PreferenceSection, Reference

__all__ = ["BETA_RANGE", "OBJECTIVES", "SIMPO_GAMMA_MAX", "PreferenceSection", "Reference", "check_objective",
           "known_objective", "reference_of"]


def known_objective(name: str) -> str:
    """``name`` if an objective of that name is registered, else ValueError (one line, the names)."""
    objective_record(name)
    return name

"""Training checkpoints: complete-or-invisible, verified, pruned, async, reshardable, local or S3.

See :mod:`.manager` for the save / resolve / load contract, :mod:`.format` for what is stored,
:mod:`.stored` for a stored checkpoint and retention, :mod:`.writer` for the storage half of a save.
"""

from nxd_finetune.checkpoint.format import CheckpointError, CheckpointWarning
from nxd_finetune.checkpoint.manager import CheckpointManager
from nxd_finetune.checkpoint.stored import CheckpointRef, list_checkpoints, retain

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointRef", "CheckpointWarning", "list_checkpoints", "retain"]

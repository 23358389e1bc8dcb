"""Training checkpoints: complete-or-invisible, verified, pruned, async, reshardable, local or S3.

See :mod:`.manager` for the save / resolve / load contract and :mod:`.format` for what is stored.
"""

from nxd_finetune.checkpoint.format import CheckpointError, CheckpointWarning
from nxd_finetune.checkpoint.manager import CheckpointManager, CheckpointRef, list_checkpoints, retain

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointRef", "CheckpointWarning", "list_checkpoints", "retain"]

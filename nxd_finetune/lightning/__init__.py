"""PyTorch Lightning interface (``pip install 'nxd-finetune[lightning]'``), as NxD Training offers one.

::

    import lightning.pytorch as pl
    from nxd_finetune.lightning import NxdLightningModule, NxdModelCheckpoint, NxdStrategy

    module = NxdLightningModule("recipes/quickstart.yaml", ["output.dir=outputs/lt"])
    trainer = pl.Trainer(devices=2, strategy=NxdStrategy(tensor_parallel_size=2), precision="bf16-mixed",
                         max_steps=100, callbacks=[NxdModelCheckpoint("outputs/lt/checkpoints",
                                                                      every_n_train_steps=50)])
    trainer.fit(module)                      # writes outputs/lt/final (the recipe's save mode)

- :class:`NxdLightningModule` (``module.py``; NxD's ``NeuronLTModule``): the recipe's model, LoRA
  and data on the one assembly every ``nxd-finetune run`` uses, one optimizer step per
  ``training_step`` with the run's token-weighted loss;
- :class:`NxdStrategy` (``strategy.py``; NxD's ``NeuronXLAStrategy``): process groups for tp x dp,
  ZeRO-1, no DDP wrapper (the parallel optimizer reduces), nxd-finetune's checkpoint format;
- :class:`NxdPrecision` (``precision.py``; NxD's ``NeuronXLAPrecisionPlugin``): fp32, bf16-mixed, bf16;
- :class:`NxdModelCheckpoint` and the checkpoint bridge (``checkpoint.py``).

Lightning is imported only inside this package.
"""

from __future__ import annotations

from nxd_finetune.errors import NxdError

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    raise NxdError("nxd_finetune.lightning needs Lightning 2.x: pip install 'nxd-finetune[lightning]'") from None

from nxd_finetune.lightning.checkpoint import NxdModelCheckpoint
from nxd_finetune.lightning.model_fn import NxdModelModule
from nxd_finetune.lightning.module import NxdLightningModule
from nxd_finetune.lightning.precision import NxdPrecision
from nxd_finetune.lightning.strategy import NxdStrategy

__all__ = ["NxdLightningModule", "NxdModelCheckpoint", "NxdModelModule", "NxdPrecision", "NxdStrategy"]

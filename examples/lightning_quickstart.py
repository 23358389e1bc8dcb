"""The quickstart recipe trained by a PyTorch Lightning ``Trainer`` (``pip install 'nxd-finetune[lightning]'``).

::

    python examples/lightning_quickstart.py                              # one process
    python examples/lightning_quickstart.py --devices 2 --tp 2           # tensor parallel
    python examples/lightning_quickstart.py --devices 2 --zero1          # dp=2 with ZeRO-1
    python examples/lightning_quickstart.py --precision bf16-mixed --max-steps 50
    python examples/lightning_quickstart.py --resume outputs/lightning-quickstart/checkpoints/step-00000050

The model, LoRA and data come from ``recipes/quickstart.yaml`` (any recipe works, with overrides as
on the command line after ``--``); the layout comes from the strategy, the precision from
``Trainer(precision=...)``. Lightning's progress bar shows loss, lr, grad norm and tokens/s; the
same metrics go to ``<out>/csv/metrics.csv`` and TensorBoard (``<out>/tb``). Checkpoints are
nxd-finetune's (``nxd-finetune run ... checkpoint.resume=<dir>`` continues them too), and the
adapter is exported to ``<out>/final`` as ``nxd-finetune run`` writes it. Lightning starts the
extra processes by re-running this script (``DDPStrategy``'s default launcher).
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "quickstart.yaml"))
    parser.add_argument("--out", default="outputs/lightning-quickstart")
    parser.add_argument("--accelerator", default="cpu", help="cpu | cuda")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    parser.add_argument("--zero1", action="store_true", help="shard optimizer states over data parallel")
    parser.add_argument("--precision", default="32-true", help="32-true | bf16-mixed | bf16-true")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--resume", default=None, help="a checkpoint (or checkpoint directory) to resume from")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. training.lr=1e-3")
    args = parser.parse_args()

    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from nxd_finetune.lightning import NxdLightningModule, NxdModelCheckpoint, NxdStrategy

    out = Path(args.out)
    module = NxdLightningModule(args.recipe, [*args.overrides, f"output.dir={out}"])
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, precision=args.precision, max_steps=args.max_steps,
        strategy=NxdStrategy(tensor_parallel_size=args.tp, zero1=args.zero1),
        logger=[CSVLogger(out, name="csv", version=""), TensorBoardLogger(out, name="tb", version="")],
        callbacks=[NxdModelCheckpoint(out / "checkpoints", every_n_train_steps=args.checkpoint_every)],
        log_every_n_steps=1,
    )
    trainer.fit(module, ckpt_path=args.resume)
    if trainer.is_global_zero:
        print(f"adapter: {out / 'final'}; last loss {module.history[-1]['train_loss']:.4f}")


if __name__ == "__main__":
    main()

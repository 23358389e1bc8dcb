"""nxd-finetune: SFT and LoRA fine-tuning of HuggingFace decoder LLMs with built-in TP/PP/ZeRO-1."""

__version__ = "0.1.0"

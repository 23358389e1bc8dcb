"""The data floor: from a recipe's ``data`` section to micro-batches, below the trainer.

Modules: :mod:`.inputs` (the model directory and tokenizer of a recipe), :mod:`.formats` (row
formats, chat templates, assistant-only masks), :mod:`.tokenize` (tokenizing rows, in worker
processes for large sets), :mod:`.datasets` (loading files, the tokenized-data cache, the eval
split), :mod:`.packing` (rows packed or padded to the sequence length), :mod:`.sampler` (the
resumable per-rank order) and :mod:`.loader` (train and eval loaders of one data-parallel rank).
``checkpoint/``, ``preflight/``, ``serve/`` and the trainer (``sft/``) import it; it imports none
of them.
"""

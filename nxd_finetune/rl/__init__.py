"""Online RL with verifiable rewards (GRPO): the sampler on the training model (``sampler.py``),
reward functions and group-normalised advantages (``rewards.py``)."""

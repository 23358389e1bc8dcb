"""After training: generating from, evaluating and serving trained adapters."""

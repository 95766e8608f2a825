"""Schedulers: the dynamic batcher for tensor models (and later the LLM engine)."""

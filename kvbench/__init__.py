"""kvbench: benchmark and tune paged KV caches for LLM serving."""

__version__ = "0.1.0"

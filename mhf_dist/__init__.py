"""mhf-dist: distributed training for hash-based generative language models (MultiHashFormer)."""

__version__ = "0.1.0"

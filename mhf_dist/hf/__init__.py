"""Hugging Face interchange: the authors' published layout (SPEC §9)."""

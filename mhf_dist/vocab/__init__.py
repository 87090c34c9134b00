"""Vocabulary: tokenizers, the token list, its hash signature tables and the Engram tokenizer compression."""

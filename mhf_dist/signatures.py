"""The signature table's first home, kept so that ``from mhf_dist.signatures import SignatureTable`` still works; it
lives in ``mhf_dist.vocab.signatures`` (also ``from mhf_dist import SignatureTable``)."""

from mhf_dist.vocab.signatures import SignatureError, SignatureTable, bucket_of

__all__ = ["SignatureError", "SignatureTable", "bucket_of"]

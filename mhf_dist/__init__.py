"""mhf-dist: distributed training for hash-based generative language models (MultiHashFormer).

The names a script uses are importable from here (docs/models.md, "Python API"): the run configuration
(``load_config``, ``RunConfig``, ``preset``, ``preset_names``), the signature table
(``SignatureTable``) and the exported Hugging Face model's classes. They load on first use, so ``import
mhf_dist`` stays as light as the command line needs. Their homes may move; these names stay.
"""

import importlib

__version__ = "0.1.0"

PUBLIC = {  # name: the module that defines it
    "load_config": "mhf_dist.config",
    "RunConfig": "mhf_dist.config",
    "preset": "mhf_dist.config",
    "preset_names": "mhf_dist.config",
    "ConfigError": "mhf_dist.errors",
    "MhfError": "mhf_dist.errors",
    "SignatureTable": "mhf_dist.vocab.signatures",
    "SignatureError": "mhf_dist.vocab.signatures",
    "MultiHashFormerConfig": "mhf_dist.hf.configuration_multihashformer",
    "MultiHashFormerModel": "mhf_dist.hf.modeling_multihashformer",
    "MultiHashFormerForCausalLM": "mhf_dist.hf.modeling_multihashformer",
}

__all__ = ["__version__", *PUBLIC]


def __getattr__(name: str):
    if name in PUBLIC:
        return getattr(importlib.import_module(PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *PUBLIC])

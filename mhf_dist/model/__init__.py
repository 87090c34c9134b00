"""Model code: reads like docs/spec.md §2–§5 and knows nothing of process groups.

The package's names are loaded on first use, so that the analytic modules
(``flops``, ``parameter_count``,
``engram_sizes``) import without torch: ``submit`` runs on
login nodes that may not have it.
"""

from importlib import import_module

_EXPORTS = {
    "LanguageModel": "lm",
    "MultiHashFormer": "lm",
    "StandardLM": "lm",
    "build_model": "lm",
    "TrainingLoss": "vocabulary",
    "Evaluation": "vocabulary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)

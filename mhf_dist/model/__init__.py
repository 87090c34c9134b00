"""Model code: reads like docs/spec.md §2–§5 and knows nothing of process groups."""

from mhf_dist.model.lm import LanguageModel, MultiHashFormer, StandardLM, build_model
from mhf_dist.model.vocabulary import LMOutput

__all__ = ["LanguageModel", "LMOutput", "MultiHashFormer", "StandardLM", "build_model"]

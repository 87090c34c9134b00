"""Model code: reads like SPEC §2–§5 and knows nothing of process groups."""

from mhf_dist.model.lm import LanguageModel, LMOutput, MultiHashFormer, StandardLM, build_model

__all__ = ["LanguageModel", "LMOutput", "MultiHashFormer", "StandardLM", "build_model"]

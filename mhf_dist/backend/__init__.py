"""The training backend: what builds the engines, steps them and saves them (docs/design.md, "The backend boundary").

Every use of DeepSpeed lives in :mod:`mhf_dist.backend.deepspeed`.
"""

"""Loading a model for generation and evaluation (``mhf-dist generate`` / ``eval``).

A model is a Hugging Face directory (``mhf-dist export-hf``), loaded with
transformers exactly as users and lm-evaluation-harness load it; a run or
checkpoint directory is exported into a temporary directory first. The model's
logits are ``log P_inf`` over the real vocabulary (docs/spec.md §5), so greedy,
sampled (temperature, top-k, top-p) and beam-search generation only ever pick
registered tokens, with the KV cache.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TextStreamer,
)

from mhf_dist.config import ConfigError
from mhf_dist.model.dtypes import DTYPES
from mhf_dist.train.trained_weights import MODEL_SOURCES, check_source


def remote_code_is_ours(path: Path) -> bool:
    """Whether every Python file of a model directory is byte for byte the model code this package exports (so
    loading it runs nothing but our own code); a directory without Python files needs no remote code."""
    ours = resources.files("mhf_dist.hf")
    for f in path.glob("*.py"):
        mine = ours.joinpath(f.name)
        if not mine.is_file() or mine.read_bytes() != f.read_bytes():
            return False
    return True


def load_for_inference(
    path: str | Path, dtype: str = "fp32", device: str = "auto", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model directory's model and tokenizer; its Python files run only when they are this package's own
    exported code or ``trust_remote_code`` says so; ``device="auto"`` is the GPU when there is one."""
    path = Path(path)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (path / "config.json").is_file():  # a run or checkpoint directory
        from mhf_dist.hf.exporter import export_hf

        check_source(path, f"an export-hf directory (with config.json), {MODEL_SOURCES}")
        with tempfile.TemporaryDirectory(prefix="mhf-export-") as tmp:
            return load_for_inference(export_hf(path, Path(tmp) / "model"), dtype, device)
    if not (trust_remote_code or remote_code_is_ours(path)):
        raise ConfigError(
            f"{path} holds Python files that differ from the model code this mhf-dist exports; "
            "loading them would run them. Pass --trust-remote-code if you trust their source, or "
            "export the model again (mhf-dist export-hf)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=True, dtype=DTYPES[dtype], local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.to(device).eval(), tokenizer


def compiled_decoding() -> dict:
    """``generate()`` options for a static KV cache and a compiled decode step, on every device.

    A token's ``log P_inf`` is some 40 small kernels (the cascade, then the signature scores), so on a GPU
    one decoding step is bound by kernel launches. transformers compiles the forward
    (``torch.compile``, mode ``reduce-overhead``: CUDA graphs) when the cache is static; on GPUs it does
    so by itself, and ``_compile_all_devices`` extends that to the CPU. The first steps pay for compilation.
    """
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


class TextPieces(TextStreamer):
    """A ``generate()`` streamer handing ``on_text`` the prompt once generation starts, then each piece of the
    generated text as soon as it is decoded (a piece ends where later tokens can no longer change it)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt: str, on_text: Callable[[str], None]
    ):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.prompt, self.on_text = prompt, on_text

    def put(self, value: torch.Tensor) -> None:
        if self.next_tokens_are_prompt:  # the first call: the prompt's ids, which the parent skips
            self.on_text(self.prompt)
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.on_text(text)


def new_token_budget(
    model: PreTrainedModel, prompt: str, prompt_tokens: int, max_new_tokens: int
) -> int:
    """``max_new_tokens``, capped (with a note) where the prompt and the new tokens would pass the model's positions;
    an error for a prompt with no tokens or with no room after it."""
    positions = model.config.max_position_embeddings
    if prompt_tokens == 0:
        raise ConfigError(f"--prompt {prompt!r} has no tokens: give some text to continue")
    room = positions - prompt_tokens
    if room < 1:
        raise ConfigError(
            f"the prompt's {prompt_tokens} tokens fill the model's {positions} positions "
            "(max_position_embeddings), leaving none to generate: shorten the prompt"
        )
    if max_new_tokens > room:
        print(
            f"note: --max-new-tokens {max_new_tokens} capped at {room}: the prompt's {prompt_tokens} tokens and the "
            f"new ones fill the model's {positions} positions (max_position_embeddings)",
            file=sys.stderr,
        )
    return min(max_new_tokens, room)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt: str,
    *,
    max_new_tokens: int = 50,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_beams: int = 1,
    seed: int = 0,
    compile: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Generated ids (prompt excluded) ``[num_new]``; ``temperature == 0`` is greedy (or beam search);
    ``compile``: ``compiled_decoding``; ``max_new_tokens`` is capped at the model's positions
    (``new_token_budget``). ``on_text`` receives the prompt, then the generated text in pieces as it is decoded
    (``TextPieces``; not with beam search, whose text is settled only at the end)."""
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    budget = new_token_budget(model, prompt, ids.shape[1], max_new_tokens)
    sample = temperature > 0
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=budget,
        do_sample=sample,
        num_beams=num_beams,
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
        streamer=TextPieces(tokenizer, prompt, on_text) if on_text is not None else None,
        **(
            {"temperature": temperature, "top_k": top_k or 0, "top_p": top_p or 1.0}
            if sample
            else {}
        ),
        **(compiled_decoding() if compile else {}),
    )
    return out[0, ids.shape[1] :]

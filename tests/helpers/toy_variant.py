"""A toy model variant, defined here and registered by the tests that use it: what a variant from outside the
package needs to be configured, built and trained, and nothing more. It is a tied token table of exactly the
vocabulary's rows (no padding), on one process's tensors only (its rows are never split over tp)."""

from __future__ import annotations

from mhf_dist.config.variants import VariantRules
from mhf_dist.model.lm import LanguageModel
from mhf_dist.model.variants import HFNames, Variant
from mhf_dist.model.vocabulary import TokenVocabulary


class ToyLM(LanguageModel):
    def __init__(self, cfg, vocab_size, compression, modes):
        vocab = TokenVocabulary(
            vocab_size, vocab_size, cfg.d_model, cfg.decoder_chunk_tokens, modes.kernels
        )
        super().__init__(cfg, vocab, compression, modes)


def _config_error(m) -> str | None:
    if m.hash.p_inf_loss_weight:
        return "model.variant=toy has no log P_inf term; unset model.hash.p_inf_loss_weight"
    return None


def _tp_rows_error(m, tp: int) -> str | None:
    return (
        f"model.variant=toy keeps its table whole: parallel.tp={tp} cannot split it; use tp 1"
        if tp > 1
        else None
    )


TOY = Variant(
    rules=VariantRules("toy", config_error=_config_error, tp_rows_error=_tp_rows_error),
    title="Toy",
    builder=lambda cfg, vocab_size, codes, compression, modes: ToyLM(
        cfg, vocab_size, compression, modes
    ),
    needs_signatures=False,
    heads=lambda cfg: 1,
    vocab_rows=lambda cfg, vocab_size: vocab_size,
    vocab_flops=lambda cfg, rows: (0, 2 * rows * cfg.d_model),
    vocab_parameters=lambda cfg, vocab_size: (vocab_size * cfg.d_model, 0),
    describe=lambda cfg: "toy",
    # a tied Qwen3 model as it is; import-hf reads such a config.json as the Standard variant's
    hf=HFNames(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        config_class="Qwen3Config",
        remote_code=False,
        model_section=lambda config: None,
    ),
)

"""The run configuration's pydantic models: one ``RunConfig`` describes a run (the model's section in ``model``,
``train``'s in ``training``).

Validation happens here, at the edge: every error names the field and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from mhf_dist.config.model import ModelConfig
from mhf_dist.config.strict import Strict
from mhf_dist.config.training import TrainConfig
from mhf_dist.errors import ConfigError

CONFIG_FILE = "config.yaml"  # a run directory's resolved config, written at every start


class TokenizerConfig(Strict):
    path: str | None = Field(
        None,
        description="a local tokenizer directory, or 'mistral-v0.3' (from mistral-common); None: the tokenizer "
        "saved with data.path's shards, or (no data.path) a byte-level BPE trained on the embedded corpus",
    )
    vocab_size: int = Field(
        4096, ge=256, description="vocabulary of the BPE trained when path is None"
    )


EMBEDDED_CORPUS = "embedded"


class DataSource(Strict):
    """One dataset of a weighted mixture (``data.sources``): a directory of shards prepared with one tokenizer."""

    path: str = Field(description="directory of token shards with a manifest")
    weight: float = Field(
        gt=0, description="its share of the samples, relative to the other sources' weights"
    )
    name: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the name in logs and metrics; None: the directory's name",
    )

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name


def parse_blend(text: str) -> list[DataSource]:
    """Megatron's blend string, ``"0.7 shards/a 0.3 shards/b"``: weight, path, weight, path, ..."""
    words = text.split()
    if len(words) % 2:
        raise ValueError(
            f"data.path={text!r}: a blend is pairs of weight and directory, e.g. '0.7 shards/a 0.3 "
            "shards/b'"
        )
    try:
        return [
            DataSource(path=path, weight=float(weight))
            for weight, path in zip(words[::2], words[1::2])
        ]
    except ValueError as e:
        raise ValueError(
            f"data.path={text!r}: a blend is pairs of a positive weight and a directory ({e})"
        ) from None


class DataConfig(Strict):
    path: str | None = Field(
        None,
        description="directory of token shards with a manifest, 'embedded' for the bundled demo text "
        "(1 MB of English), or a blend of weighted directories ('0.7 shards/a 0.3 shards/b', read into "
        "data.sources); None: the embedded text for tiny presets, an error before launch for every other run",
    )
    sources: list[DataSource] | None = Field(
        None,
        description="a weighted mixture of shard directories, [{path, weight, name}, ...], all of one "
        "tokenizer and seq_len; each source's samples come in its share of every 4,096 (data/mixture.py)",
    )
    seq_len: int = Field(128, ge=2)
    shuffle_seed: int | None = Field(
        None,
        ge=0,
        description="seed of the global sample order over shards (docs/spec.md §7); None: train.seed",
    )
    shuffle_window: int = Field(
        16, ge=1, description="shards whose samples are interleaved and shuffled together"
    )
    on_bad_shard: Literal["error", "skip"] = Field(
        "error",
        description="a missing, truncated or corrupt shard: stop with an error, or skip it with a warning",
    )
    verify_checksums: bool = Field(
        True, description="check every shard's SHA-256 against the manifest while reading"
    )
    allow_pipe: bool = Field(
        False, description="accept pipe: shard URLs (each runs a shell command)"
    )
    document_masking: bool = Field(
        False,
        description="keep the documents packed in a sequence apart: attention stays within each document, RoPE "
        "positions restart at every document start, and the Engram memory's N-grams and convolution do not reach "
        "across one; a document starts at the sequence start and after each EOS (the EOS ends its document). "
        "The loss then leaves out each EOS's prediction of the next document's first token and is the mean over the "
        "global batch's counted tokens. "
        "False: the paper's recipe, causal attention over the whole packed sequence (docs/data.md)",
    )
    restart: bool = Field(
        False,
        description="on resume, when the checkpoint's data position is in other data (another data.path's "
        "shards, data.shuffle_seed, data.shuffle_window or data seed), start this data's order from its beginning "
        "instead of refusing; weights, optimizer and learning-rate schedule continue. A position in this same data "
        "is continued, so a requeued job does not restart twice. Applies to the start it is given to (config.yaml "
        "keeps false); without a checkpoint it does nothing",
    )

    @model_validator(mode="before")
    @classmethod
    def _blend(cls, data):
        """A blend in ``path`` is read into ``sources`` (so a saved config names them one way)."""
        if (
            isinstance(data, dict)
            and isinstance(data.get("path"), str)
            and len(data["path"].split()) > 1
        ):
            if data.get("sources"):
                raise ValueError(
                    "data.path holds a blend and data.sources is set too: give the mixture once"
                )
            data = data | {"path": None, "sources": parse_blend(data["path"])}
        return data

    @model_validator(mode="after")
    def _one_kind_of_data(self):
        if self.sources is not None:
            if self.path is not None:
                raise ValueError(
                    f"data.path={self.path!r} and data.sources are both set: give one directory in "
                    "data.path, or every directory as a source"
                )
            if not self.sources:
                raise ValueError("data.sources is empty: list at least one {path, weight}")
            labels = [s.label for s in self.sources]
            if len(set(labels)) < len(labels):
                raise ValueError(
                    f"data.sources have the same name twice ({', '.join(labels)}): give each a name"
                )
        return self

    @property
    def shard_dir(self) -> str | None:
        """The shard directory named by ``path`` (or a mixture's first source, whose tokenizer every source
        shares); None for the embedded corpus."""
        if self.sources:
            return self.sources[0].path
        return None if self.path in (None, EMBEDDED_CORPUS) else self.path


Family = Literal["tables", "engram", "gate", "decoder", "backbone", "norms"]
"""A parameter family (``mhf_dist.model.families``): the bucket tables (the Standard embedding), the Engram
memories, the hash gate, the cascaded decoder, the backbone (its blocks and final norm, Engram left out) and every
norm gain."""


class ParamGroupRule(Strict):
    """One entry of ``optimizer.groups``: the parameters of family ``match`` get this learning-rate scale and weight
    decay (unset: as before this rule)."""

    match: Family
    lr_scale: float | None = Field(None, ge=0, description="multiplies the scheduled learning rate")
    weight_decay: float | None = Field(None, ge=0)


WSD_DECAY_FRACTION = 0.2  # optimizer.decay_fraction's value when unset
WSD_DECAY_SHAPE = "1-sqrt"  # optimizer.decay_shape's value when unset
Schedule = Literal["cosine", "wsd", "linear", "constant"]
DecayShape = Literal["linear", "cosine", "1-sqrt"]


class OptimizerConfig(Strict):
    """AdamW with linear warm-up, then the learning-rate schedule ``schedule`` (docs/schedules.md); by default the
    paper's cosine decay to ``min_lr_ratio * lr`` (docs/spec.md §6)."""

    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="where a decay ends, as a fraction of lr (cosine, linear, wsd); constant never decays",
    )
    warmup_steps: int = Field(100, ge=0)
    schedule: Schedule = Field(
        "cosine",
        description="after warm-up: cosine (the paper's recipe) or linear decay to min_lr_ratio at max_steps; "
        "wsd: stable at lr, then a decay over the run's end (decay_start, decay_fraction, decay_shape), whose "
        "runs can be extended and decayed from any checkpoint; constant: lr to the end",
    )
    decay_start: int | None = Field(
        None,
        ge=0,
        description="wsd: the last step before the decay (a checkpoint's step, to decay from it); None: "
        "decay_fraction sets it",
    )
    decay_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description=f"wsd: the share of max_steps the decay takes at the end (rounded; never into the warm-up); "
        f"None: {WSD_DECAY_FRACTION}",
    )
    decay_shape: DecayShape | None = Field(
        None, description=f"wsd: the decay's curve; None: {WSD_DECAY_SHAPE}"
    )
    allow_lr_jump: bool = Field(
        False,
        description="a resume whose max_steps or schedule settings would make the learning rate jump at the "
        "resumed step goes on with the jump instead of being refused; applies to the start it is given to "
        "(config.yaml keeps false)",
    )
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="Adam's moment decays, each in [0, 1)"
    )
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    groups: list[ParamGroupRule] = Field(
        default_factory=list,
        description="rules applied in order, each setting lr_scale and/or weight_decay for a family's parameters; "
        "before them every parameter has lr_scale 1 and weight_decay on matrices and tables, none on biases and norm "
        "gains (the empty default)",
    )

    @model_validator(mode="after")
    def _betas(self):
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(
                    f"optimizer.betas[{i}]={beta} is outside [0, 1): Adam's moment decays are "
                    "fractions, e.g. --set optimizer.betas=[0.9,0.95]"
                )
        return self

    @model_validator(mode="after")
    def _schedule(self):
        if self.schedule != "wsd":
            for name in ("decay_start", "decay_fraction", "decay_shape"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"optimizer.{name}={getattr(self, name)} with optimizer.schedule={self.schedule}: only "
                        f"wsd has a decay phase to place; set optimizer.schedule=wsd, or leave {name} unset"
                    )
        if self.schedule == "constant" and self.min_lr_ratio:
            raise ValueError(
                f"optimizer.min_lr_ratio={self.min_lr_ratio} with optimizer.schedule=constant, which never "
                "decays: leave min_lr_ratio at 0, or decay at the end with optimizer.schedule=wsd"
            )
        if self.decay_start is not None and self.decay_start < self.warmup_steps:
            raise ValueError(
                f"optimizer.decay_start={self.decay_start} falls in the warm-up (optimizer.warmup_steps="
                f"{self.warmup_steps}): the decay begins after it; set decay_start to {self.warmup_steps} or later"
            )
        return self


class ParallelConfig(Strict):
    """Parallel layout (docs/spec.md §7); data parallel is derived: world size / (tp * pp). Then the engine's own
    settings, which the backend reads."""

    tp: int = Field(1, ge=1, description="tensor-parallel ranks (bucket tables split along B)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    zero_stage: int | None = Field(
        None,
        ge=0,
        le=3,
        description="None: the DeepSpeed file's stage, else 3 when pp == 1 and 1 when pp > 1",
    )
    activation_checkpoint_interval: int | None = Field(
        None,
        ge=0,
        description="recompute every k-th block's activations in backward; 0 disables; "
        "None: 1 when the DeepSpeed file has an activation_checkpointing section, else 0",
    )
    deepspeed_config: str = Field(
        "auto",
        description="a file in deepspeed_configs/ (name without .json) or a path; auto: cpu_fp32 on CPU, "
        "zero3_bf16_actckpt (pp = 1) or zero1_pp_bf16 (pp > 1) on GPUs",
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed keys that override everything else (nested dicts merge)",
    )


class InferenceConfig(Strict):
    """How the exported model infers (``mhf-dist export-hf``, restored by ``import-hf``)."""

    temperature: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="τ: an exported MultiHashFormer's logits are "
        "log_softmax(τ · log P_inf) over the vocabulary (calibration; training's evaluations fit it as "
        "val_temperature); 1: P_inf itself. export-hf --inference-temperature sets it; a Standard model exports "
        "only with 1",
    )


class RunConfig(Strict):
    preset: str | None = None
    model: ModelConfig
    tokenizer: TokenizerConfig = TokenizerConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    inference: InferenceConfig = InferenceConfig()

    @model_validator(mode="after")
    def _layout(self):
        tp, m = self.parallel.tp, self.model
        if rows_error := m.tp_rows_error(tp):  # the vocabulary tables' rows are split over tp
            raise ValueError(rows_error)
        if m.n_heads % tp:
            raise ValueError(
                f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}; choose tp dividing it"
            )
        m.kv_heads_split(tp)
        if m.ffn_dim % tp:
            raise ValueError(
                f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}; choose tp dividing it"
            )
        if m.engram is not None and m.engram.pad_rows_to % tp:
            raise ValueError(
                f"model.engram.pad_rows_to={m.engram.pad_rows_to} is not a multiple of parallel.tp={tp}: memory "
                "tables are split along their rows; set pad_rows_to to a multiple of tp"
            )
        if m.engram is not None and m.engram.offload is True and self.parallel.pp > 1:
            raise ValueError(
                f"model.engram.offload=true with parallel.pp={self.parallel.pp}: whole host tables support pp = 1 "
                "only; set model.engram.offload=sharded (each stage's rows split over its ranks) or use pp = 1"
            )
        if m.engram is not None and m.engram.offload is True and tp > 1:
            raise ValueError(
                f"model.engram.offload=true with parallel.tp={tp}: whole host tables support tp = 1 only; set "
                "model.engram.offload=sharded (the rows split over every rank) or use tp = 1"
            )
        if self.train.on_spike == "rollback" and self.data.sources:
            raise ValueError(
                "train.on_spike=rollback with data.sources: a rollback skips a range of one reader's "
                "global order, which a mixture does not have; use train.on_spike=skip with a mixture"
            )
        if self.parallel.zero_stage is not None:
            self.check_zero_stage(
                self.parallel.zero_stage, f"parallel.zero_stage={self.parallel.zero_stage}"
            )
        if self.parallel.pp > m.n_layers:
            raise ValueError(
                f"parallel.pp={self.parallel.pp} is more stages than model.n_layers={m.n_layers}; lower pp"
            )
        return self

    @model_validator(mode="after")
    def _decay_before_the_end(self):
        start, steps = self.optimizer.decay_start, self.train.max_steps
        if start is not None and start >= steps:
            raise ValueError(
                f"optimizer.decay_start={start} is not before train.max_steps={steps}: no step would decay; "
                f"set decay_start below {steps}, or raise train.max_steps (the decay runs from decay_start to it)"
            )
        return self

    def check_zero_stage(self, stage: int, source: str) -> None:
        """The ZeRO ``stage`` this run trains with (``source`` says where it is set) must fit its layout: the pipeline
        engine takes ZeRO-0/1 only, and host-memory Engram tables need ZeRO's optimizer."""
        if self.model.engram is not None and self.model.engram.offload and stage == 0:
            raise ConfigError(
                f"model.engram.offload with {source}: the host tables' gradient norm joins the clipping norm of "
                "DeepSpeed's ZeRO optimizer; use parallel.zero_stage 1, 2 or 3"
            )
        if stage == 0 and self.train.on_spike != "warn":
            raise ConfigError(
                f"train.on_spike={self.train.on_spike} with {source}: a step is left out inside DeepSpeed's ZeRO "
                "optimizer, once it has the step's gradient norm; use parallel.zero_stage 1, 2 or 3"
            )
        if self.parallel.pp > 1 and stage >= 2:
            raise ConfigError(
                f"{source} with parallel.pp={self.parallel.pp}: DeepSpeed's pipeline engine refuses ZeRO-2/3; "
                "use parallel.zero_stage=1 (or leave it unset with deepspeed_config auto or zero1_pp_bf16)"
            )


def check_data_source(cfg: RunConfig, on_this_machine: bool = True) -> None:
    """Only tiny presets may train on the embedded demo text without saying so; a real run names its shards, which
    must exist when the run starts here (a job script's data lives on the cluster: ``on_this_machine=False``)."""
    if (
        cfg.data.path is None
        and cfg.data.sources is None
        and not (cfg.preset or "").startswith("tiny-")
    ):
        raise ConfigError(
            f"data.path is not set for {'preset ' + cfg.preset if cfg.preset else 'this run'}: point it at a "
            "directory of shards (--set data.path=DIR; `mhf-dist prepare-data` makes them), or pass "
            f"--set data.path={EMBEDDED_CORPUS} to train on the 1 MB demo text on purpose"
        )
    if cfg.data.sources:
        named = [(f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources)]
    else:
        named = [("data.path", cfg.data.shard_dir)] if cfg.data.shard_dir is not None else []
    for key, shards in named:
        if "://" in shards:  # object storage, read through fsspec (data/reader.py)
            if cfg.tokenizer.path is None:
                raise ConfigError(
                    f"{key}={shards} is a URL, whose tokenizer/ a run does not load: set tokenizer.path "
                    "to the tokenizer the shards were prepared with, copied to local or shared storage"
                )
            continue
        if on_this_machine and not Path(shards).is_dir():
            raise ConfigError(
                f"{key}={shards}: no such directory; point it at the --out of `mhf-dist prepare-data`"
            )

"""The run configuration's pydantic models: one :class:`RunConfig` describes a run.

Validation happens here, at the edge: every error names the field and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from mhf_dist.backend import EngineSettings, check_zero_stage
from mhf_dist.errors import ConfigError

CONFIG_FILE = "config.yaml"  # a run directory's resolved config, written at every start


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class HashConfig(_Strict):
    """Signatures and the hash encoder/decoder (docs/spec.md §1, §2, §4)."""

    num_hashes: int = Field(4, ge=1, description="H: hash coordinates per token")
    num_buckets: int = Field(16384, ge=2, description="B: rows per bucket table; bucket 0 is padding")
    single_id: bool = Field(False, description="H1 ablation: one hash copied into all H coordinates (non-unique)")
    gate_dim: int = Field(64, ge=1, description="d_z of the encoder's gate MLP (docs/spec.md §2)")
    mixer_dim: int = Field(64, ge=1, description="r of the decoder's cascade mixers (docs/spec.md §4)")
    p_inf_loss_weight: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="λ: adds λ × mean(−log P_inf(target)) to the training loss, the NLL of the distribution "
        "inference uses (exact renormalisation over the registered vocabulary, in chunks; MultiHashFormer only). "
        "λ > 0 runs the decoder unfused (decoder_chunk_tokens unused): the term needs every head's scores, so "
        "activation memory grows from O(chunk × B) to O(N × H × B / tp) for N tokens per micro-batch; 0: off")


class EngramConfig(_Strict):
    """Engram N-gram memory (docs/spec.md §8), added to the residual stream before the attention of ``layers``.

    Choices where docs/spec.md §8 is silent: each head's table has the smallest unused prime ``>= table_size`` rows
    (distinct over heads, orders and layers, assigned in that nesting: layer, order, head); the ``engram``
    hash and ``sigmoid`` gate (DeepSeek's public demo) are the defaults; ``head_dim`` makes the concatenated
    head vectors ``d_model`` wide for the sigmoid gate (DeepSeek's proportions), and must be ``d_model`` for
    the softmax gate, whose scores are ``h · E_k[idx_k]``.
    """

    layers: list[int] | None = Field(None, description="backbone layers (0-based) with a memory; None: 1 and L/2")
    max_ngram: int = Field(3, ge=2, description="N: N-grams of orders 2..N")
    heads: int = Field(4, ge=1, description="K: hash heads (tables) per order")
    table_size: int = Field(65536, ge=2, description="rows per head table: the next unused prime >= this")
    head_dim: int | None = Field(
        None, ge=1, description="width of a table row; None: d_model for the softmax gate, "
        "d_model / ((N-1)·K) for the sigmoid gate")
    hash: Literal["engram", "keyed"] = Field(
        "engram", description="engram: XOR of per-token odd multipliers (DeepSeek); keyed: the packed N-gram "
        "times a per-head key, XOR the key (docs/spec.md §8); 'seed' is read as keyed")
    gate: Literal["sigmoid", "softmax"] = Field(
        "sigmoid", description="sigmoid: scalar gate on a projected value + short causal conv (DeepSeek); "
        "softmax: weights over the heads from h · E_k (docs/spec.md §8)")
    threshold: float | None = Field(
        None, description="softmax gate: heads scoring below this are masked (None: no mask)")
    kernel_size: int = Field(4, ge=1, description="sigmoid gate: taps of the causal depthwise convolution")
    seed: int = Field(0, description="RNG seed of the hash multipliers/keys (per layer: seed + 10007·layer)")
    pad_rows_to: int = Field(
        128, ge=1, description="tables are padded to a multiple of this many rows (a multiple of parallel.tp)")
    offload: bool = Field(
        False, description="keep the tables in (pinned) host memory outside DeepSpeed: each micro-batch's rows "
        "are gathered to the device ahead of use, their gradients added back on the host, and the tables step "
        "with a host AdamW of the same hyperparameters (pp = tp = 1, ZeRO 1-3)")
    offload_update: Literal["dense", "lazy"] = Field(
        "dense", description="the host AdamW with offload: dense: every row each step, equal to the tables on the "
        "device; lazy: only the rows read in the step (by any micro-batch on any data-parallel rank): their "
        "moments, weight decay and update, bias-corrected by the global step count; the other rows and their "
        "moments stay as they are (LazyAdam, SparseAdam)")

    @field_validator("hash", mode="before")
    @classmethod
    def _keyed_alias(cls, value):
        return "keyed" if value == "seed" else value  # the mode's former name

    @model_validator(mode="after")
    def _gate(self):
        if self.threshold is not None and self.gate != "softmax":
            raise ValueError(f"model.engram.threshold applies to gate=softmax only (gate is {self.gate!r}); "
                             "unset the threshold or set model.engram.gate=softmax")
        if self.offload_update != "dense" and not self.offload:
            raise ValueError(f"model.engram.offload_update={self.offload_update} applies to host-memory tables only; "
                             "set model.engram.offload=true or unset model.engram.offload_update")
        return self


class ModelConfig(_Strict):
    """Backbone shape (docs/spec.md §3) and which input/output the model uses."""

    variant: Literal["mhf", "standard"] = Field("mhf", description="MultiHashFormer or the tied-embedding baseline")
    d_model: int = Field(ge=1)
    n_layers: int = Field(ge=1)
    n_heads: int = Field(ge=1)
    n_kv_heads: int = Field(ge=1)
    head_dim: int | None = Field(None, description="defaults to d_model / n_heads")
    ffn_dim: int = Field(ge=1)
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    pad_vocab_to: int = Field(128, ge=1, description="Standard: embedding rows rounded up to this multiple")
    decoder_chunk_tokens: int = Field(
        8192, ge=0, description="training loss: decoder fused over chunks of this many tokens (activation memory "
        "O(chunk × B): a chunk's logits live only inside one head's forward or backward); 0: the plain path, which "
        "keeps every head's logits (reference)")
    hash: HashConfig = HashConfig()
    engram: EngramConfig | None = Field(None, description="Engram N-gram memory (docs/spec.md §8); None: no memory")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def padded_vocab_rows(self, vocab_size: int) -> int:
        """Standard: table rows for ``vocab_size`` tokens, rounded up to ``pad_vocab_to``."""
        return -(-vocab_size // self.pad_vocab_to) * self.pad_vocab_to

    def kv_heads_split(self, tp: int) -> bool:
        """How tp ranks share the kv heads: True, split over the ranks (``n_kv_heads`` a multiple of tp); False,
        each rank computes the one replicated kv head its query heads share (``n_kv_heads`` divides tp)."""
        if self.n_kv_heads % tp == 0:
            return True
        if tp % self.n_kv_heads == 0:
            return False
        raise ConfigError(
            f"model.n_kv_heads={self.n_kv_heads} neither divides nor is a multiple of parallel.tp={tp}: kv heads "
            "are split over tp or replicated per rank; choose tp as a divisor or multiple of n_kv_heads"
        )

    @property
    def engram_layers(self) -> list[int]:
        """Layers holding a memory, ascending (none without ``engram``); docs/spec.md §8's example: 1 and L/2."""
        if self.engram is None:
            return []
        if self.engram.layers is None:
            return sorted({min(1, self.n_layers - 1), self.n_layers // 2})
        return sorted(self.engram.layers)

    @property
    def engram_head_dim(self) -> int:
        e = self.engram
        if e.head_dim is not None:
            return e.head_dim
        return self.d_model if e.gate == "softmax" else self.d_model // ((e.max_ngram - 1) * e.heads)

    @model_validator(mode="after")
    def _shapes(self):
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "change one of them or set model.head_dim"
            )
        if self.engram is not None:
            self._check_engram()
        if self.variant == "standard" and self.hash.p_inf_loss_weight:
            raise ValueError(
                f"model.hash.p_inf_loss_weight={self.hash.p_inf_loss_weight} with model.variant=standard: a Standard "
                "model's P_inf is its head's softmax, so the term would repeat its training loss; unset it")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads} (GQA groups); "
                "pick n_kv_heads dividing n_heads"
            )
        return self

    def _check_engram(self) -> None:
        e, layers = self.engram, self.engram_layers
        if e.layers is not None and len(set(e.layers)) != len(e.layers):
            raise ValueError(f"model.engram.layers={e.layers} names a layer twice; list each layer once")
        outside = [i for i in layers if not 0 <= i < self.n_layers]
        if outside:
            raise ValueError(
                f"model.engram.layers={layers}: layer {outside[0]} is out of range for model.n_layers="
                f"{self.n_layers}; use 0..{self.n_layers - 1}")
        if e.gate == "softmax" and self.engram_head_dim != self.d_model:
            raise ValueError(
                f"model.engram.head_dim={e.head_dim} with gate=softmax: its scores h · E_k[idx] need rows of "
                f"model.d_model={self.d_model}; unset model.engram.head_dim")
        if e.head_dim is None and e.gate == "sigmoid" and self.d_model % ((e.max_ngram - 1) * e.heads):
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by (max_ngram-1)·heads = "
                f"{(e.max_ngram - 1) * e.heads}; set model.engram.head_dim")


class TokenizerConfig(_Strict):
    path: str | None = Field(
        None,
        description="a local tokenizer directory, or 'mistral-v0.3' (from mistral-common); None: the tokenizer "
        "saved with data.path's shards, or (no data.path) a byte-level BPE trained on the embedded corpus",
    )
    vocab_size: int = Field(4096, ge=256, description="vocabulary of the BPE trained when path is None")


EMBEDDED_CORPUS = "embedded"


class DataSource(_Strict):
    """One dataset of a weighted mixture (``data.sources``): a directory of shards prepared with one tokenizer."""

    path: str = Field(description="directory of token shards with a manifest")
    weight: float = Field(gt=0, description="its share of the samples, relative to the other sources' weights")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="the name in logs and metrics; None: the directory's name")

    @property
    def label(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name


def parse_blend(text: str) -> list[DataSource]:
    """Megatron's blend string, ``"0.7 shards/a 0.3 shards/b"``: weight, path, weight, path, ..."""
    words = text.split()
    if len(words) % 2:
        raise ValueError(f"data.path={text!r}: a blend is pairs of weight and directory, e.g. '0.7 shards/a 0.3 "
                         "shards/b'")
    try:
        return [DataSource(path=path, weight=float(weight)) for weight, path in zip(words[::2], words[1::2])]
    except ValueError as e:
        raise ValueError(f"data.path={text!r}: a blend is pairs of a positive weight and a directory ({e})") from None


class DataConfig(_Strict):
    path: str | None = Field(
        None, description="directory of token shards with a manifest, 'embedded' for the bundled demo text "
        "(1 MB of English), or a blend of weighted directories ('0.7 shards/a 0.3 shards/b', read into "
        "data.sources); None: the embedded text for tiny presets, an error before launch for every other run")
    sources: list[DataSource] | None = Field(
        None, description="a weighted mixture of shard directories, [{path, weight, name}, ...], all of one "
        "tokenizer and seq_len; each source's samples come in its share of every 4,096 (data/mixture.py)")
    seq_len: int = Field(128, ge=2)
    shuffle_seed: int | None = Field(
        None, ge=0, description="seed of the global sample order over shards (docs/spec.md §7); None: train.seed"
    )
    shuffle_window: int = Field(16, ge=1, description="shards whose samples are interleaved and shuffled together")
    on_bad_shard: Literal["error", "skip"] = Field(
        "error", description="a missing, truncated or corrupt shard: stop with an error, or skip it with a warning"
    )
    verify_checksums: bool = Field(True, description="check every shard's SHA-256 against the manifest while reading")
    allow_pipe: bool = Field(False, description="accept pipe: shard URLs (each runs a shell command)")
    restart: bool = Field(
        False, description="on resume, when the checkpoint's data position is in other data (another data.path's "
        "shards, data.shuffle_seed, data.shuffle_window or data seed), start this data's order from its beginning "
        "instead of refusing; weights, optimizer and learning-rate schedule continue. A position in this same data "
        "is continued, so a requeued job does not restart twice. Applies to the start it is given to (config.yaml "
        "keeps false); without a checkpoint it does nothing")

    @model_validator(mode="before")
    @classmethod
    def _blend(cls, data):
        """A blend in ``path`` is read into ``sources`` (so a saved config names them one way)."""
        if isinstance(data, dict) and isinstance(data.get("path"), str) and len(data["path"].split()) > 1:
            if data.get("sources"):
                raise ValueError("data.path holds a blend and data.sources is set too: give the mixture once")
            data = data | {"path": None, "sources": parse_blend(data["path"])}
        return data

    @model_validator(mode="after")
    def _one_kind_of_data(self):
        if self.sources is not None:
            if self.path is not None:
                raise ValueError(f"data.path={self.path!r} and data.sources are both set: give one directory in "
                                 "data.path, or every directory as a source")
            if not self.sources:
                raise ValueError("data.sources is empty: list at least one {path, weight}")
            labels = [s.label for s in self.sources]
            if len(set(labels)) < len(labels):
                raise ValueError(f"data.sources have the same name twice ({', '.join(labels)}): give each a name")
        return self

    @property
    def shard_dir(self) -> str | None:
        """The shard directory named by ``path`` (or a mixture's first source, whose tokenizer every source
        shares); None for the embedded corpus."""
        if self.sources:
            return self.sources[0].path
        return None if self.path in (None, EMBEDDED_CORPUS) else self.path


class OptimizerConfig(_Strict):
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio * lr`` (docs/spec.md §6)."""

    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam's moment decays, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")


    @model_validator(mode="after")
    def _betas(self):
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"optimizer.betas[{i}]={beta} is outside [0, 1): Adam's moment decays are "
                                 "fractions, e.g. --set optimizer.betas=[0.9,0.95]")
        return self


class _Layout(_Strict):
    tp: int = Field(1, ge=1, description="tensor-parallel ranks (bucket tables split along B)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    zero_stage: int | None = Field(
        None, ge=0, le=3, description="None: the DeepSpeed file's stage, else 3 when pp == 1 and 1 when pp > 1"
    )
    activation_checkpoint_interval: int | None = Field(
        None, ge=0, description="recompute every k-th block's activations in backward; 0 disables; "
        "None: 1 when the DeepSpeed file has an activation_checkpointing section, else 0"
    )


class ParallelConfig(EngineSettings, _Layout):
    """Parallel layout (docs/spec.md §7); data parallel is derived: world size / (tp * pp). The engine's own
    settings come last, from the backend (:class:`~mhf_dist.backend.EngineSettings`)."""


class WandbConfig(_Strict):
    """Weights & Biases logging from rank 0 (needs ``pip install 'mhf-dist[wandb]'``): the scalars of
    ``metrics.jsonl``, with the run config; every start of a run directory logs to the same W&B run."""

    project: str | None = Field(None, min_length=1, description="W&B project; required unless mode is disabled")
    entity: str | None = Field(None, min_length=1, description="W&B user or team; None: your default entity")
    name: str | None = Field(None, min_length=1, description="display name; None: the run directory's name")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="offline: write RUN/wandb/ only, upload later with `wandb sync`; disabled: no W&B at all; "
        "None: the WANDB_MODE environment variable, else online")

    @model_validator(mode="after")
    def _project(self):
        if self.project is None and self.mode != "disabled":
            raise ValueError("a W&B project is required: --set train.wandb.project=NAME (or turn W&B off: "
                             "--set train.wandb=null)")
        return self


class TrainConfig(_Strict):
    max_steps: int = Field(200, ge=1, description="optimizer steps; the LR schedule always follows it")
    global_batch_size: int = Field(8, ge=1, description="sequences per optimizer step, over all ranks")
    micro_batch_size: int = Field(
        8, ge=1, description="sequences per forward pass per rank; a preset's value is a ceiling that the layout "
        "lowers to the largest that divides global_batch_size / dp, a value you set is kept (or refused, naming "
        "the values that fit)")
    _micro_batch_from_preset: bool = PrivateAttr(False)

    @property
    def micro_batch_from_preset(self) -> bool:
        """``micro_batch_size`` is the preset's: no config file or ``--set`` named it (see ``load_config``)."""
        return self._micro_batch_from_preset
    seed: int = Field(42, ge=0, description="seeds the initial weights and (unless data.shuffle_seed) the data order")
    dtype: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the ranks compute: auto is a GPU where one is visible; cpu trains on the CPUs "
        "also on a GPU host")
    log_interval: int = Field(1, ge=1, description="log every N steps (and always step 1 and the last)")
    eval_interval: int = Field(
        0, ge=0, description="evaluate on the validation split every N steps; 0: only at the end")
    eval_sequences: int = Field(
        32, ge=1, description="validation sequences per evaluation, over all ranks (rounded down to whole "
        "micro-batches per data-parallel rank, at least one), the same set in every layout")
    checkpoint_interval: int = Field(0, ge=0, description="save a checkpoint every N steps; 0: only at the end")
    checkpoint_minutes: float | None = Field(
        None, gt=0, description="also save when this many minutes passed since the last save (or the start), "
        "decided together by all ranks; None: by steps only")
    keep_checkpoints: int = Field(3, ge=1, description="complete checkpoints kept (older ones are deleted)")
    checkpoint_async: bool = Field(
        False, description="save while training continues: training waits only while each rank copies its part of "
        "the checkpoint into host memory (which holds it until written: as much host RAM as the rank's share of a "
        "checkpoint); a background thread writes, fsyncs and digests the files, then complete.json; the next save, "
        "the end of training and a preemption wait for it")
    on_nonfinite: Literal["stop", "warn"] = Field(
        "stop", description="a step whose loss or gradient norm is NaN/inf: stop the run after "
        "train.max_nonfinite_steps of them in a row (exit 2, nothing saved after the last finite step), or only warn; "
        "a checkpoint is never saved from non-finite weights either way")
    max_nonfinite_steps: int = Field(3, ge=1, description="consecutive non-finite steps that stop the run")
    spike_factor: float | None = Field(
        None, gt=1, description="warn (and count loss_spikes in metrics) when a step's loss exceeds this multiple of "
        "the median of the last 50 finite losses; None: no spike detection")
    stop_at_step: int | None = Field(
        None, ge=1, description="save and end at this step; the LR schedule still follows max_steps"
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="dense peak TFLOP/s of one device in train.dtype, for MFU; None: measured"
    )
    compile: bool = Field(
        False, description="torch.compile every backbone block (the decoder's fused autograd stays eager); off by "
        "default: see docs/benchmarks.md for what it gains on your hardware")
    fused_head_kernel: Literal["auto", "compiled", "eager"] = Field(
        "auto", description="the decoder's fused-head elementwise passes: auto compiles them on GPUs and falls back "
        "to eager (one warning) when compiling fails (no Triton, an Inductor error); compiled always compiles "
        "(a failure stops the run); eager never compiles")
    dist_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="torch.distributed backend: auto is nccl on GPUs (RCCL on ROCm) and gloo on CPUs; gloo "
        "on GPUs runs several ranks on one device (checks, not training speed)")
    dist_timeout_minutes: float = Field(
        30, gt=0, description="how long a collective may wait for the slowest rank before the job stops (the "
        "process group's timeout); work that grows with the model, such as converting a checkpoint for another "
        "layout, is waited for outside collectives")
    init_from: str | None = Field(
        None, description="start from these weights (a model.safetensors with our parameter names, as export, "
        "import-hf and expand-vocab write; relative to the run directory) instead of a random init; a resumed "
        "run loads it first, then its checkpoint (which does not hold frozen parameters)")
    trainable_blocks: int | None = Field(
        None, ge=0, description="train only the vocabulary side (tables, encoder, decoder), the final norm and the "
        "first and last k blocks, as the paper's vocabulary-expansion stage does; None: every parameter")
    wandb: WandbConfig | None = Field(
        None, description="log to Weights & Biases too (--set train.wandb.project=NAME turns it on); None: off")

    @model_validator(mode="after")
    def _batches(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}; make it one"
            )
        if self.trainable_blocks is not None and self.init_from is None:
            raise ValueError("train.trainable_blocks freezes most of the backbone, which only makes sense for "
                             "trained weights: set train.init_from too (expand-vocab does)")
        return self


class InferenceConfig(_Strict):
    """How the exported model infers (``mhf-dist export-hf``, restored by ``import-hf``)."""

    temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="τ: an exported MultiHashFormer's logits are "
        "log_softmax(τ · log P_inf) over the vocabulary (calibration; training's evaluations fit it as "
        "val_temperature); 1: P_inf itself. export-hf --inference-temperature sets it; a Standard model exports "
        "only with 1")


class RunConfig(_Strict):
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
        if m.variant == "mhf" and m.hash.num_buckets % tp:
            raise ValueError(
                f"model.hash.num_buckets={m.hash.num_buckets} is not divisible by parallel.tp={tp}: "
                "bucket tables are split along B; choose B as a multiple of tp"
            )
        if m.n_heads % tp:
            raise ValueError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}; choose tp dividing it")
        m.kv_heads_split(tp)
        if m.ffn_dim % tp:
            raise ValueError(f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}; choose tp dividing it")
        if m.variant == "standard" and m.pad_vocab_to % tp:
            raise ValueError(
                f"model.pad_vocab_to={m.pad_vocab_to} is not a multiple of parallel.tp={tp}: the vocabulary rows are "
                "split over tp; set pad_vocab_to to a multiple of tp"
            )
        if m.engram is not None and m.engram.pad_rows_to % tp:
            raise ValueError(
                f"model.engram.pad_rows_to={m.engram.pad_rows_to} is not a multiple of parallel.tp={tp}: memory "
                "tables are split along their rows; set pad_rows_to to a multiple of tp"
            )
        if m.engram is not None and m.engram.offload and (tp > 1 or self.parallel.pp > 1):
            raise ValueError(
                f"model.engram.offload with parallel.tp={tp}, parallel.pp={self.parallel.pp}: host-memory tables "
                "support tp = pp = 1 only (dp may be any); unset model.engram.offload or use tp = pp = 1")
        if self.parallel.zero_stage is not None:
            check_zero_stage(self, self.parallel.zero_stage, f"parallel.zero_stage={self.parallel.zero_stage}")
        if self.parallel.pp > m.n_layers:
            raise ValueError(
                f"parallel.pp={self.parallel.pp} is more stages than model.n_layers={m.n_layers}; lower pp"
            )
        return self


def check_data_source(cfg: RunConfig, on_this_machine: bool = True) -> None:
    """Only tiny presets may train on the embedded demo text without saying so; a real run names its shards, which
    must exist when the run starts here (a job script's data lives on the cluster: ``on_this_machine=False``)."""
    if cfg.data.path is None and cfg.data.sources is None and not (cfg.preset or "").startswith("tiny-"):
        raise ConfigError(
            f"data.path is not set for {'preset ' + cfg.preset if cfg.preset else 'this run'}: point it at a "
            "directory of shards (--set data.path=DIR; `mhf-dist prepare-data` makes them), or pass "
            f"--set data.path={EMBEDDED_CORPUS} to train on the 1 MB demo text on purpose")
    if cfg.data.sources:
        named = [(f"data.sources[{i}].path", s.path) for i, s in enumerate(cfg.data.sources)]
    else:
        named = [("data.path", cfg.data.shard_dir)] if cfg.data.shard_dir is not None else []
    for key, shards in named:
        if "://" in shards:  # object storage, read through fsspec (data/reader.py)
            if cfg.tokenizer.path is None:
                raise ConfigError(f"{key}={shards} is a URL, whose tokenizer/ a run does not load: set tokenizer.path "
                                  "to the tokenizer the shards were prepared with, copied to local or shared storage")
            continue
        if on_this_machine and not Path(shards).is_dir():
            raise ConfigError(f"{key}={shards}: no such directory; point it at the --out of `mhf-dist prepare-data`")

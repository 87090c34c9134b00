"""The run configuration's pydantic models: one ``RunConfig`` describes a run.

Validation happens here, at the edge: every error names the field and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from mhf_dist.config.model import ModelConfig
from mhf_dist.config.strict import Strict
from mhf_dist.errors import ConfigError

CONFIG_FILE = "config.yaml"  # a run directory's resolved config, written at every start


class TokenizerConfig(Strict):
    path: str | None = Field(
        None,
        description="a local tokenizer directory, or 'mistral-v0.3' (from mistral-common); None: the tokenizer "
        "saved with data.path's shards, or (no data.path) a byte-level BPE trained on the embedded corpus",
    )
    vocab_size: int = Field(4096, ge=256, description="vocabulary of the BPE trained when path is None")


EMBEDDED_CORPUS = "embedded"


class DataSource(Strict):
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


class DataConfig(Strict):
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


class OptimizerConfig(Strict):
    """AdamW with linear warm-up then cosine decay to ``min_lr_ratio * lr`` (docs/spec.md §6)."""

    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    warmup_steps: int = Field(100, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam's moment decays, each in [0, 1)")
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    groups: list[ParamGroupRule] = Field(
        default_factory=list,
        description="rules applied in order, each setting lr_scale and/or weight_decay for a family's parameters; "
        "before them every parameter has lr_scale 1 and weight_decay on matrices and tables, none on biases and norm "
        "gains (the empty default)")


    @model_validator(mode="after")
    def _betas(self):
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise ValueError(f"optimizer.betas[{i}]={beta} is outside [0, 1): Adam's moment decays are "
                                 "fractions, e.g. --set optimizer.betas=[0.9,0.95]")
        return self


class ParallelConfig(Strict):
    """Parallel layout (docs/spec.md §7); data parallel is derived: world size / (tp * pp). Then the engine's own
    settings, which the backend reads."""

    tp: int = Field(1, ge=1, description="tensor-parallel ranks (bucket tables split along B)")
    pp: int = Field(1, ge=1, description="pipeline stages")
    zero_stage: int | None = Field(
        None, ge=0, le=3, description="None: the DeepSpeed file's stage, else 3 when pp == 1 and 1 when pp > 1"
    )
    activation_checkpoint_interval: int | None = Field(
        None, ge=0, description="recompute every k-th block's activations in backward; 0 disables; "
        "None: 1 when the DeepSpeed file has an activation_checkpointing section, else 0"
    )
    deepspeed_config: str = Field(
        "auto",
        description="a file in deepspeed_configs/ (name without .json) or a path; auto: cpu_fp32 on CPU, "
        "zero3_bf16_actckpt (pp = 1) or zero1_pp_bf16 (pp > 1) on GPUs",
    )
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="DeepSpeed keys that override everything else (nested dicts merge)"
    )


class WandbConfig(Strict):
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


class TrainConfig(Strict):
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
        None, gt=1, description="a loss spike: a step's loss above this multiple of the median of the last 50 "
        "finite, unspiked losses (counted as loss_spikes in metrics; train.on_spike says what is done); None: the "
        "loss is not watched for spikes")
    grad_spike_factor: float | None = Field(
        None, gt=1, description="a gradient spike: a step's global gradient norm above this multiple of the median "
        "of the last 50 unspiked norms (counted as grad_spikes); None: the norm is not watched for spikes")
    on_spike: Literal["warn", "skip", "rollback"] = Field(
        "warn", description="a loss or gradient spike (train.spike_factor, train.grad_spike_factor): warn only; "
        "skip: the step applies no update (weights, optimizer moments and Adam's step count stay as they were, "
        "a step with a non-finite loss or norm too), while the learning-rate schedule and the data move on; "
        "counted in skipped_steps; rollback: skip, and once train.spike_patience spikes fell within the last 50 "
        "steps, go back to the newest checkpoint saved before the first of them and skip the data read since it "
        "(recorded in RUN/rollbacks.json), at most train.max_rollbacks times. Needs spike_factor or "
        "grad_spike_factor, and ZeRO (stage 1-3) for the norm")
    spike_patience: int = Field(
        3, ge=1, description="train.on_spike=rollback: spikes within the last 50 steps that roll the run back (the "
        "ones before are skipped)")
    max_rollbacks: int = Field(
        3, ge=0, description="train.on_spike=rollback: rollbacks a run may make (RUN/rollbacks.json counts them); "
        "the next spike past them stops the run (exit 2), naming its steps and the checkpoint to resume from")
    stop_at_step: int | None = Field(
        None, ge=1, description="save and end at this step; the LR schedule still follows max_steps"
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="dense peak TFLOP/s of one device in train.dtype, for MFU; None: measured"
    )
    compile: bool = Field(
        False, description="torch.compile every backbone block (the decoder's fused autograd stays eager); off by "
        "default: see docs/benchmarks.md for what it gains on your hardware. Under ZeRO-3 (one pipeline stage at "
        "ZeRO stage 3, the default there) it measured no gain: DeepSpeed's parameter hooks are not compiled, so "
        "each block's graph breaks at every submodule, and the first step still pays for compiling")
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
    hang_timeout_s: float | None = Field(
        900, gt=0, description="a step, evaluation (between micro-batches) or save (while its files stop changing) "
        "that makes no progress for this long is a hang: every rank writes its Python stacks to RUN/hangs/<time>/, "
        "the log names the ranks that stopped answering or fell behind (from their heartbeats in RUN/heartbeats/), "
        "and the job exits 87 for its scheduler to requeue it; the next start allows the phase it ended twice as "
        "long, and stops (exit 2) if it ends there again; None: no watchdog")
    first_step_timeout_s: float | None = Field(
        3600, gt=0, description="the first step and evaluation of every start (compiling, allocating) and a "
        "rollback's load may go this long without progress instead, when it is longer than train.hang_timeout_s; "
        "None: train.hang_timeout_s for them too")
    peer_timeout_s: float | None = Field(
        120, gt=0, description="a rank whose heartbeat (RUN/heartbeats/) is this old has been lost with its node: the "
        "others stop at once, naming the node and its ranks, and exit 88, on which an elastic job (submit --nodes "
        "MIN-MAX) continues on the nodes left; None: wait for the process group's timeout")
    straggler_factor: float = Field(
        1.2, gt=1, description="warn when a rank's own compute time per step (its training thread's CPU time) "
        "exceeds this multiple of the median of its pipeline stage's other ranks for train.straggler_intervals log "
        "intervals in a row, naming the rank and its node")
    straggler_intervals: int = Field(3, ge=1, description="consecutive slow log intervals before the warning")
    device_probe: bool | None = Field(
        None, description="at every logged step, time the same fixed matrix products on each rank's device and warn, "
        "as for train.straggler_factor, when a rank's device is slower than the median of the others' (a throttled "
        "or degraded GPU, which the compute time per step, the host's share of it, does not show); waits for the "
        "device before and after, an estimated 1 ms per log interval on an H100 in bf16; None: on GPU ranks, off "
        "on CPU ranks")
    health_metrics: bool = Field(
        True, description="every logged step also reports, per parameter family and block, gradient and parameter "
        "norms and update ratios, and the hash model's bucket, gate and head statistics (docs/usage.md, "
        "\"Health metrics\"); one more small all-reduce per log interval")
    init_from: str | None = Field(
        None, description="start from these weights (a model.safetensors with our parameter names, as export, "
        "import-hf and expand-vocab write; relative to the run directory) instead of a random init; a resumed "
        "run loads it first, then its checkpoint (which does not hold frozen parameters)")
    trainable_blocks: int | None = Field(
        None, ge=0, description="train only the vocabulary side (tables, encoder, decoder), the final norm and the "
        "first and last k blocks, as the paper's vocabulary-expansion stage does; None: every parameter")
    wandb: WandbConfig | None = Field(
        None, description="log to Weights & Biases too (--set train.wandb.project=NAME turns it on); None: off")
    callbacks: list[str] = Field(
        default_factory=list, description="callbacks of your own, each a Callback class (mhf_dist.train.callbacks) "
        "named module:Class, importable where the ranks run (installed, or on PYTHONPATH); made at start, after the "
        "run's monitors (docs/training.md, \"Callbacks\")")

    @model_validator(mode="after")
    def _batches(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}; make it one"
            )
        if self.on_spike != "warn" and self.spike_factor is None and self.grad_spike_factor is None:
            raise ValueError(f"train.on_spike={self.on_spike} with neither train.spike_factor nor "
                             "train.grad_spike_factor: nothing is a spike; set one of them (e.g. train.spike_factor=3)")
        if self.trainable_blocks is not None and self.init_from is None:
            raise ValueError("train.trainable_blocks freezes most of the backbone, which only makes sense for "
                             "trained weights: set train.init_from too (expand-vocab does)")
        return self


class InferenceConfig(Strict):
    """How the exported model infers (``mhf-dist export-hf``, restored by ``import-hf``)."""

    temperature: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="τ: an exported MultiHashFormer's logits are "
        "log_softmax(τ · log P_inf) over the vocabulary (calibration; training's evaluations fit it as "
        "val_temperature); 1: P_inf itself. export-hf --inference-temperature sets it; a Standard model exports "
        "only with 1")


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
            raise ValueError(f"model.n_heads={m.n_heads} is not divisible by parallel.tp={tp}; choose tp dividing it")
        m.kv_heads_split(tp)
        if m.ffn_dim % tp:
            raise ValueError(f"model.ffn_dim={m.ffn_dim} is not divisible by parallel.tp={tp}; choose tp dividing it")
        if m.engram is not None and m.engram.pad_rows_to % tp:
            raise ValueError(
                f"model.engram.pad_rows_to={m.engram.pad_rows_to} is not a multiple of parallel.tp={tp}: memory "
                "tables are split along their rows; set pad_rows_to to a multiple of tp"
            )
        if m.engram is not None and m.engram.offload and (tp > 1 or self.parallel.pp > 1):
            raise ValueError(
                f"model.engram.offload with parallel.tp={tp}, parallel.pp={self.parallel.pp}: host-memory tables "
                "support tp = pp = 1 only (dp may be any); unset model.engram.offload or use tp = pp = 1")
        if self.train.on_spike == "rollback" and self.data.sources:
            raise ValueError("train.on_spike=rollback with data.sources: a rollback skips a range of one reader's "
                             "global order, which a mixture does not have; use train.on_spike=skip with a mixture")
        if self.parallel.zero_stage is not None:
            self.check_zero_stage(self.parallel.zero_stage, f"parallel.zero_stage={self.parallel.zero_stage}")
        if self.parallel.pp > m.n_layers:
            raise ValueError(
                f"parallel.pp={self.parallel.pp} is more stages than model.n_layers={m.n_layers}; lower pp"
            )
        return self

    def check_zero_stage(self, stage: int, source: str) -> None:
        """The ZeRO ``stage`` this run trains with (``source`` says where it is set) must fit its layout: the pipeline
        engine takes ZeRO-0/1 only, and host-memory Engram tables need ZeRO's optimizer."""
        if self.model.engram is not None and self.model.engram.offload and stage == 0:
            raise ConfigError(
                f"model.engram.offload with {source}: the host tables' gradient norm joins the clipping norm of "
                "DeepSpeed's ZeRO optimizer; use parallel.zero_stage 1, 2 or 3")
        if stage == 0 and self.train.on_spike != "warn":
            raise ConfigError(
                f"train.on_spike={self.train.on_spike} with {source}: a step is left out inside DeepSpeed's ZeRO "
                "optimizer, once it has the step's gradient norm; use parallel.zero_stage 1, 2 or 3")
        if self.parallel.pp > 1 and stage >= 2:
            raise ConfigError(
                f"{source} with parallel.pp={self.parallel.pp}: DeepSpeed's pipeline engine refuses ZeRO-2/3; "
                "use parallel.zero_stage=1 (or leave it unset with deepspeed_config auto or zero1_pp_bf16)"
            )


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

"""The run configuration's ``train`` section: ``TrainConfig`` (steps, batches, evaluation, checkpoints, divergence,
watchdogs, callbacks, profiler windows) and ``WandbConfig``, its ``train.wandb``; ``RunConfig`` (``schema``) holds
it as ``train``.

Validation happens here, at the edge: every error names the field and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from mhf_dist.config.strict import Strict


def profile_step_range(value: object) -> tuple[int, int]:
    """``train.profile_steps`` (``FIRST-LAST``, or one step) as (first, last); a ValueError naming the form
    otherwise."""
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    window = (int(found[1]), int(found[2] or found[1])) if found else (0, 0)
    if not (1 <= window[0] <= window[1]):
        raise ValueError(
            f"{value!r} is not a window of steps: give FIRST-LAST with 1 <= FIRST <= LAST, e.g. "
            "train.profile_steps=10-12 (one step: train.profile_steps=10)"
        )
    return window


class WandbConfig(Strict):
    """Weights & Biases logging from rank 0 (needs ``pip install 'mhf-dist[wandb]'``): the scalars of
    ``metrics.jsonl``, with the run config; every start of a run directory logs to the same W&B run."""

    project: str | None = Field(
        None, min_length=1, description="W&B project; required unless mode is disabled"
    )
    entity: str | None = Field(
        None, min_length=1, description="W&B user or team; None: your default entity"
    )
    name: str | None = Field(
        None, min_length=1, description="display name; None: the run directory's name"
    )
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="offline: write RUN/wandb/ only, upload later with `wandb sync`; disabled: no W&B at all; "
        "None: the WANDB_MODE environment variable, else online",
    )

    @model_validator(mode="after")
    def _project(self):
        if self.project is None and self.mode != "disabled":
            raise ValueError(
                "a W&B project is required: --set train.wandb.project=NAME (or turn W&B off: "
                "--set train.wandb=null)"
            )
        return self


class TrainConfig(Strict):
    max_steps: int = Field(
        200, ge=1, description="optimizer steps; the LR schedule always follows it"
    )
    global_batch_size: int = Field(
        8, ge=1, description="sequences per optimizer step, over all ranks"
    )
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="sequences per forward pass per rank; a preset's value is a ceiling that the layout "
        "lowers to the largest that divides global_batch_size / dp, a value you set is kept (or refused, naming "
        "the values that fit)",
    )
    _micro_batch_from_preset: bool = PrivateAttr(False)

    @property
    def micro_batch_from_preset(self) -> bool:
        """``micro_batch_size`` is the preset's: no config file or ``--set`` named it (see ``load_config``)."""
        return self._micro_batch_from_preset

    seed: int = Field(
        42,
        ge=0,
        description="seeds the initial weights and (unless data.shuffle_seed) the data order",
    )
    dtype: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="where the ranks compute: auto is a GPU where one is visible; cpu trains on the CPUs "
        "also on a GPU host",
    )
    log_interval: int = Field(
        1, ge=1, description="log every N steps (and always step 1 and the last)"
    )
    eval_interval: int = Field(
        0, ge=0, description="evaluate on the validation split every N steps; 0: only at the end"
    )
    eval_sequences: int = Field(
        32,
        ge=1,
        description="validation sequences per evaluation, over all ranks (rounded down to whole "
        "micro-batches per data-parallel rank, at least one), the same set in every layout",
    )
    eval_tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks (as lm_eval --tasks) scored on the model inside the run "
        "under log P_inf, every train.eval_tasks_interval steps and at the last, logged as eval/<task>/<metric> "
        '(loglikelihood and multiple-choice tasks; docs/models.md, "Downstream tasks during training")',
    )
    eval_tasks_path: list[str] = Field(
        default_factory=list,
        description="directories of lm-eval task configs (YAML) for train.eval_tasks, as lm_eval "
        "--include_path; the tasks read local files only (the Hugging Face hub stays offline)",
    )
    eval_tasks_interval: int | None = Field(
        None, ge=1, description="score train.eval_tasks every N steps; None: train.eval_interval's"
    )
    eval_tasks_samples: bool = Field(
        False,
        description="also write each request of train.eval_tasks, as lm-eval logs samples, to "
        "RUN/eval/<step>/<task>.jsonl",
    )
    checkpoint_interval: int = Field(
        0, ge=0, description="save a checkpoint every N steps; 0: only at the end"
    )
    checkpoint_minutes: float | None = Field(
        None,
        gt=0,
        description="also save when this many minutes passed since the last save (or the start), "
        "decided together by all ranks; None: by steps only",
    )
    keep_checkpoints: int = Field(
        3, ge=1, description="complete checkpoints kept (older ones are deleted)"
    )
    checkpoint_async: bool = Field(
        False,
        description="save while training continues: training waits only while each rank copies its part of "
        "the checkpoint into host memory (which holds it until written: as much host RAM as the rank's share of a "
        "checkpoint); a background thread writes, fsyncs and digests the files, then complete.json; the next save, "
        "the end of training and a preemption wait for it",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="where checkpoints are kept: None, RUN/checkpoints; an absolute path (a directory every "
        "node sees, e.g. on a larger file system than the run directory's); or a URL of object storage "
        "(s3://bucket/prefix, any scheme fsspec knows), into which each rank uploads its files after writing them "
        "in train.checkpoint_staging (with train.checkpoint_async, in the background)",
    )
    checkpoint_staging: str | None = Field(
        None,
        description="a node-local directory where a save with a URL train.checkpoint_dir writes its files "
        "before the upload, and a resume downloads the checkpoint it loads (created when missing; may be "
        "deleted between jobs)",
    )
    on_nonfinite: Literal["stop", "warn"] = Field(
        "stop",
        description="a step whose loss or gradient norm is NaN/inf: stop the run after "
        "train.max_nonfinite_steps of them in a row (exit 2, nothing saved after the last finite step), or only warn; "
        "a checkpoint is never saved from non-finite weights either way",
    )
    max_nonfinite_steps: int = Field(
        3, ge=1, description="consecutive non-finite steps that stop the run"
    )
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="a loss spike: a step's loss above this multiple of the median of the last 50 "
        "finite, unspiked losses (counted as loss_spikes in metrics; train.on_spike says what is done); None: the "
        "loss is not watched for spikes",
    )
    grad_spike_factor: float | None = Field(
        None,
        gt=1,
        description="a gradient spike: a step's global gradient norm above this multiple of the median "
        "of the last 50 unspiked norms (counted as grad_spikes); None: the norm is not watched for spikes",
    )
    on_spike: Literal["warn", "skip", "rollback"] = Field(
        "warn",
        description="a loss or gradient spike (train.spike_factor, train.grad_spike_factor): warn only; "
        "skip: the step applies no update (weights, optimizer moments and Adam's step count stay as they were, "
        "a step with a non-finite loss or norm too), while the learning-rate schedule and the data move on; "
        "counted in skipped_steps; rollback: skip, and once train.spike_patience spikes fell within the last 50 "
        "steps, go back to the newest checkpoint saved before the first of them and skip the data read since it "
        "(recorded in RUN/rollbacks.json), at most train.max_rollbacks times. Needs spike_factor or "
        "grad_spike_factor, and ZeRO (stage 1-3) for the norm",
    )
    spike_patience: int = Field(
        3,
        ge=1,
        description="train.on_spike=rollback: spikes within the last 50 steps that roll the run back (the "
        "ones before are skipped)",
    )
    max_rollbacks: int = Field(
        3,
        ge=0,
        description="train.on_spike=rollback: rollbacks a run may make (RUN/rollbacks.json counts them); "
        "the next spike past them stops the run (exit 2), naming its steps and the checkpoint to resume from",
    )
    stop_at_step: int | None = Field(
        None, ge=1, description="save and end at this step; the LR schedule still follows max_steps"
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="dense peak TFLOP/s of one device in train.dtype, for MFU; None: measured",
    )
    compile: bool = Field(
        False,
        description="torch.compile every backbone block (the decoder's fused autograd stays eager); off by "
        "default: see docs/benchmarks.md for what it gains on your hardware. Under ZeRO-3 (one pipeline stage at "
        "ZeRO stage 3, the default there) it measured no gain: DeepSpeed's parameter hooks are not compiled, so "
        "each block's graph breaks at every submodule, and the first step still pays for compiling",
    )
    fused_head_kernel: Literal["auto", "compiled", "eager"] = Field(
        "auto",
        description="the decoder's fused-head elementwise passes: auto compiles them on GPUs and falls back "
        "to eager (one warning) when compiling fails (no Triton, an Inductor error); compiled always compiles "
        "(a failure stops the run); eager never compiles",
    )
    z_loss_weight: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="z-loss: adds this weight × the mean over the target tokens of (log Z)² to the training "
        "loss, log Z being a decoder head's softmax normaliser (summed over a MultiHashFormer's H heads), which keeps "
        "the normalisers from drifting (PaLM uses 1e-4; for bf16 and large models); logged as z_loss, while loss "
        "stays the cross-entropy; 0: off, the paper's recipe",
    )
    dist_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="torch.distributed backend: auto is nccl on GPUs (RCCL on ROCm) and gloo on CPUs; gloo "
        "on GPUs runs several ranks on one device (checks, not training speed)",
    )
    dist_timeout_minutes: float = Field(
        30,
        gt=0,
        description="how long a collective may wait for the slowest rank before the job stops (the "
        "process group's timeout); work that grows with the model, such as converting a checkpoint for another "
        "layout, is waited for outside collectives",
    )
    hang_timeout_s: float | None = Field(
        900,
        gt=0,
        description="a step, evaluation (between micro-batches) or save (while its files stop changing) "
        "that makes no progress for this long is a hang: every rank writes its Python stacks to RUN/hangs/<time>/, "
        "the log names the ranks that stopped answering or fell behind (from their heartbeats in RUN/heartbeats/), "
        "and the job exits 87 for its scheduler to requeue it; the next start allows the phase it ended twice as "
        "long, and stops (exit 2) if it ends there again; None: no watchdog",
    )
    first_step_timeout_s: float | None = Field(
        3600,
        gt=0,
        description="the first step and evaluation of every start (compiling, allocating), a profiled step "
        "(train.profile_steps) and a rollback's load may go this long without progress instead, when it is "
        "longer than train.hang_timeout_s; None: train.hang_timeout_s for them too",
    )
    peer_timeout_s: float | None = Field(
        120,
        gt=0,
        description="a rank whose heartbeat (RUN/heartbeats/) is this old has been lost with its node: the "
        "others stop at once, naming the node and its ranks, and exit 88, on which an elastic job (submit --nodes "
        "MIN-MAX) continues on the nodes left; None: wait for the process group's timeout",
    )
    straggler_factor: float = Field(
        1.2,
        gt=1,
        description="warn when a rank's own compute time per step (its training thread's CPU time) "
        "exceeds this multiple of the median of its pipeline stage's other ranks for train.straggler_intervals log "
        "intervals in a row, naming the rank and its node",
    )
    straggler_intervals: int = Field(
        3, ge=1, description="consecutive slow log intervals before the warning"
    )
    device_probe: bool | None = Field(
        None,
        description="at every logged step, time the same fixed matrix products on each rank's device and warn, "
        "as for train.straggler_factor, when a rank's device is slower than the median of the others' (a throttled "
        "or degraded GPU, which the compute time per step, the host's share of it, does not show); waits for the "
        "device before and after, an estimated 1 ms per log interval on an H100 in bf16; None: on GPU ranks, off "
        "on CPU ranks",
    )
    health_metrics: bool = Field(
        True,
        description="every logged step also reports, per parameter family and block, gradient and parameter "
        "norms and update ratios, and the hash model's bucket, gate and head statistics (docs/usage.md, "
        '"Health metrics"); one more small all-reduce per log interval',
    )
    init_from: str | None = Field(
        None,
        description="start from these weights (a model.safetensors with our parameter names, as export, "
        "import-hf and expand-vocab write; relative to the run directory) instead of a random init; a resumed "
        "run loads it first, then its checkpoint (which does not hold frozen parameters)",
    )
    trainable_blocks: int | None = Field(
        None,
        ge=0,
        description="train only the vocabulary side (tables, encoder, decoder), the final norm and the "
        "first and last k blocks, as the paper's vocabulary-expansion stage does; None: every parameter",
    )
    wandb: WandbConfig | None = Field(
        None,
        description="log to Weights & Biases too (--set train.wandb.project=NAME turns it on); None: off",
    )
    callbacks: list[str] = Field(
        default_factory=list,
        description="callbacks of your own, each a Callback class (mhf_dist.train.callbacks) "
        "named module:Class, importable where the ranks run (installed, or on PYTHONPATH); made at start, after the "
        'run\'s monitors (docs/training.md, "Callbacks")',
    )

    profile_steps: str | None = Field(
        None,
        description="record steps FIRST-LAST (e.g. 100-102; one step: 100) with torch.profiler on the ranks "
        "of train.profile_ranks: a Chrome/Perfetto trace per rank (operators with their shapes and Python stacks) "
        "in RUN/profiles/step-FIRST-LAST/, and on GPUs each rank's CUDA memory history over the window; the "
        'other steps run without a profiler (docs/profiling.md, "Profiling inside a run"); None: no window',
    )
    profile_window: int = Field(
        3,
        ge=1,
        description="steps recorded from the next step on when a file RUN/profile-now appears in a running "
        "run (a number of steps in the file wins)",
    )
    profile_ranks: list[int] | None = Field(
        None,
        description="the ranks that record a profiled window (the others run it unprofiled); None: every rank",
    )

    @field_validator("eval_tasks")
    @classmethod
    def _eval_tasks(cls, value):
        if any(not name.strip() for name in value):
            raise ValueError("train.eval_tasks: a task name is empty; name lm-eval tasks")
        return [name.strip() for name in value]

    @field_validator("eval_tasks_path")
    @classmethod
    def _eval_tasks_path(cls, value):
        missing = [path for path in value if not Path(path).expanduser().is_dir()]
        if missing:
            raise ValueError(
                f"train.eval_tasks_path: {missing} is not a directory; give directories of lm-eval task "
                "configs (YAML)"
            )
        return [str(Path(path).expanduser()) for path in value]

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _profile_steps(cls, value):
        if value is None:
            return None
        first, last = profile_step_range(value)
        return f"{first}-{last}"

    @field_validator("profile_ranks", mode="before")
    @classmethod
    def _profile_ranks(cls, value):
        value = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if isinstance(value, list) and any(isinstance(r, int) and r < 0 for r in value):
            raise ValueError(f"{value} names a negative rank; ranks count from 0")
        return value

    @property
    def profiled_steps(self) -> tuple[int, int] | None:
        """``profile_steps`` as (first, last), both recorded; None: no window."""
        return None if self.profile_steps is None else profile_step_range(self.profile_steps)

    @model_validator(mode="after")
    def _checkpoint_location(self):
        from mhf_dist.remote import is_url

        if self.checkpoint_dir is None:
            if self.checkpoint_staging is not None:
                raise ValueError(
                    "train.checkpoint_staging is only used with a URL train.checkpoint_dir (object storage); "
                    "set one, or drop train.checkpoint_staging"
                )
            return self
        if not is_url(self.checkpoint_dir):
            if not Path(self.checkpoint_dir).is_absolute():
                raise ValueError(
                    f"train.checkpoint_dir={self.checkpoint_dir!r} is a relative path, which each node and each "
                    "later start could read differently: give an absolute one (a directory every node sees), or "
                    "object storage as s3://bucket/prefix"
                )
            if self.checkpoint_staging is not None:
                raise ValueError(
                    f"train.checkpoint_staging is only used with a URL train.checkpoint_dir (object storage); "
                    f"{self.checkpoint_dir} is written directly: drop train.checkpoint_staging"
                )
            return self
        if not self.checkpoint_staging:
            raise ValueError(
                f"train.checkpoint_dir={self.checkpoint_dir} is object storage, which needs "
                "train.checkpoint_staging: a node-local directory where each rank writes its files before "
                "uploading them (and a resume downloads them), e.g. train.checkpoint_staging=/tmp/ckpt-staging"
            )
        if is_url(self.checkpoint_staging):
            raise ValueError(
                f"train.checkpoint_staging={self.checkpoint_staging!r} must be a local directory, not a URL"
            )
        return self

    @model_validator(mode="after")
    def _batches(self):
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}; make it one"
            )
        if self.on_spike != "warn" and self.spike_factor is None and self.grad_spike_factor is None:
            raise ValueError(
                f"train.on_spike={self.on_spike} with neither train.spike_factor nor "
                "train.grad_spike_factor: nothing is a spike; set one of them (e.g. train.spike_factor=3)"
            )
        if self.trainable_blocks is not None and self.init_from is None:
            raise ValueError(
                "train.trainable_blocks freezes most of the backbone, which only makes sense for "
                "trained weights: set train.init_from too (expand-vocab does)"
            )
        if self.profiled_steps is not None and self.profiled_steps[0] > self.max_steps:
            raise ValueError(
                f"train.profile_steps={self.profile_steps} begins after train.max_steps={self.max_steps}: "
                "no step would be recorded; give steps of the run"
            )
        return self

"""Slow ranks made visible. Each rank measures its own compute time per step: the CPU seconds of its training thread in
the step (on a CPU device that thread's share of the compute, its OpenMP workers taking equal shares), which a rank
waiting in a gloo collective or for its data does not spend, so a rank that is slow itself stands out from the ranks
that wait for it. Background threads (the reader's prefetch, the heartbeat) are left out: their bursts would blur a
step's figure. Every log interval one small collective gathers each rank's mean; rank 0 logs the median, the slowest
rank and its ratio to the median of the other ranks of its pipeline stage (the stages do different work; one slow rank
of two shows its own slowness, not half of it), and warns, naming the rank and its node (from its heartbeat), when the
ratio exceeds ``train.straggler_factor`` for ``train.straggler_intervals`` intervals in a row.

On GPU ranks that measure is the host's share of the step: a rank starved of CPU shows. A slow device shows in the
device probe's measure (``mhf_dist.train.device_probe``, ``train.device_probe``, on by default on GPUs): the same
fixed work timed on every rank's device at each logged step, gathered in the same collective and judged the same way
against the median of all other ranks. ``Stragglers`` is the watch as a run's callback.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from mhf_dist.config import TrainConfig
from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.storage.heartbeats import read_heartbeats
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train.callbacks import Callback, RunContext, Stepped
from mhf_dist.train.device_probe import DeviceProbe


@dataclass(frozen=True)
class Measure:
    """How one measure of the ranks is reported: its record keys and what its warnings say."""

    rank_key: str  # the slowest rank
    ratio_key: str  # its ratio to the median of the ranks it is compared with
    record_key: str  # {rank, node, ratio, intervals} while a rank stays slow
    slow: str  # "is a straggler: ..." with {ratio} and {count}
    recovered: str  # "is no longer a straggler" with {rank}


COMPUTE = Measure(
    "slowest_rank",
    "slowest_ratio",
    "straggler",
    "is a straggler: its compute time per step is {ratio:.2f}x the median of its pipeline stage's "
    "other ranks for {count} log intervals",
    "rank {rank} is no longer a straggler",
)
DEVICE = Measure(
    "slowest_device_rank",
    "slowest_device_ratio",
    "slow_device",
    "has a slow device: the device probe's fixed matrix products take {ratio:.2f}x the median of the "
    "other ranks' devices for {count} log intervals",
    "rank {rank}'s device is no longer slow",
)


@dataclass(frozen=True)
class StragglerSettings:
    """When a rank or its device is slow: past ``factor`` times the median for ``intervals`` log intervals in a
    row; ``device_probe``: whether the device probe runs (None: on GPU ranks)."""

    factor: float
    intervals: int
    device_probe: bool | None = None

    @classmethod
    def of(cls, train: TrainConfig) -> StragglerSettings:
        return cls(train.straggler_factor, train.straggler_intervals, train.device_probe)


class StragglerWatch:
    """Rank ``rank`` of ``world``'s compute times (and its device probe's, when ``probe`` is given), gathered and
    judged every log interval (the heartbeats in ``run`` name a slow rank's node)."""

    def __init__(
        self,
        settings: StragglerSettings,
        *,
        run: RunDir,
        rank: int,
        world: int,
        stage: int,
        scalars: ScalarCollectives,
        probe: DeviceProbe | None = None,
    ):
        self.run, self.rank, self.world = run, rank, world
        self.factor, self.intervals = settings.factor, settings.intervals
        self.stage = (
            stage  # the rank's pipeline stage: ranks are compared with the others of theirs
        )
        self.scalars, self.device_probe = scalars, probe
        self._seconds, self._steps = 0.0, 0
        self._device_s = 0.0  # the probe's seconds at the interval's logged step
        self._slow: dict[Measure, tuple[int, int] | None] = {
            COMPUTE: None,
            DEVICE: None,
        }  # (rank, intervals)

    def clock(self) -> float:
        """The rank's compute clock (the calling thread's CPU seconds)."""
        return time.thread_time()

    def add(self, seconds: float) -> None:
        """One step's compute seconds."""
        self._seconds += seconds
        self._steps += 1

    def probe(self) -> None:
        """At the start of a logged step, outside its compute clock: the device probe's measure, when it runs."""
        if self.device_probe is not None:
            self._device_s = self.device_probe.measure()

    def interval(self) -> tuple[dict, list[str]]:
        """Every rank, at each logged step: gather the interval's means (one collective); on rank 0, the record's
        fields and the warnings about ranks that stayed slow or recovered; elsewhere ``({}, [])``."""
        w, probed = self.world, self.device_probe is not None
        # each rank's compute seconds, then its stage, then its device probe's seconds
        mine = [0.0] * (3 * w)
        mine[self.rank], mine[w + self.rank] = self._seconds / max(1, self._steps), self.stage
        mine[2 * w + self.rank] = self._device_s
        self._seconds, self._steps = 0.0, 0
        gathered = mine if w == 1 else self.scalars.read(self.scalars.sum_tensor(mine))
        if self.rank != 0:
            return {}, []
        times, stages, device = gathered[:w], gathered[w : 2 * w], gathered[2 * w :]
        fields = {"compute_s": statistics.median(times)} | (
            {"device_s": statistics.median(device)} if probed else {}
        )
        warnings: list[str] = []
        self._judge(COMPUTE, ratios(times, stages), fields, warnings)
        if probed:
            self._judge(DEVICE, ratios(device, [0] * w), fields, warnings)
        return fields, warnings

    def _judge(
        self, measure: Measure, by_rank: dict[int, float], fields: dict, warnings: list[str]
    ) -> None:
        """The slowest rank of ``by_rank`` into ``fields``; a warning when it has stayed above the factor for the
        intervals (said once) or a rank that had is below it again."""
        if not by_rank:  # no two ranks to compare
            return
        slowest = max(by_rank, key=by_rank.get)
        ratio = by_rank[slowest]
        fields |= {measure.rank_key: slowest, measure.ratio_key: ratio}
        before, self._slow[measure] = self._slow[measure], None
        if ratio <= self.factor:
            if before is not None and before[1] >= self.intervals:
                warnings.append(measure.recovered.format(rank=before[0]) + f" ({ratio:.2f}x)")
            return
        count = before[1] + 1 if before and before[0] == slowest else 1
        self._slow[measure] = (slowest, count)
        if count < self.intervals:
            return
        node = next(
            (b.get("node") for b in read_heartbeats(self.run) if b["rank"] == slowest),
            "its node unknown",
        )
        fields[measure.record_key] = {
            "rank": slowest,
            "node": node,
            "ratio": ratio,
            "intervals": count,
        }
        if count == self.intervals:  # said once; the records and status keep showing it
            warnings.append(
                f"rank {slowest} on {node} "
                + measure.slow.format(ratio=ratio, count=count)
                + f" (train.straggler_factor={self.factor:g})"
            )


def ratios(times: list[float], groups: list[float]) -> dict[int, float]:
    """Each rank's time against the median of the other ranks of its group (ranks alone in theirs are left out)."""
    by_rank = {}
    for r, t in enumerate(times):
        peers = [u for q, u in enumerate(times) if q != r and groups[q] == groups[r]]
        if peers and (median := statistics.median(peers)) > 0:
            by_rank[r] = t / median
    return by_rank


class Stragglers(Callback):
    """The straggler watch of a run: each step's compute time, the device probe at the start of a logged step, and
    the ranks' times gathered and judged into the record (rank 0 says the warnings)."""

    def __init__(self, settings: StragglerSettings):
        self.settings = settings

    def on_start(self, run: RunContext) -> None:
        job, settings = run.job, self.settings
        probed = (
            settings.device_probe
            if settings.device_probe is not None
            else job.device.type == "cuda"
        )
        dtype = torch.bfloat16 if run.cfg.train.dtype == "bf16" else torch.float32
        self.progress = run.progress
        probe = DeviceProbe(job.device, dtype, job.rank) if probed else None
        self.watch = StragglerWatch(
            settings,
            run=run.run,
            rank=job.rank,
            world=job.world,
            stage=job.groups.pp_rank,
            scalars=job.scalars,
            probe=probe,
        )

    def before_step(self, step: int) -> None:
        if self.progress.logged(step):
            self.watch.probe()  # outside the step's compute clock
        self.began = self.watch.clock()

    def after_step(self, step: int, stepped: Stepped) -> None:
        self.watch.add(self.watch.clock() - self.began)

    def record(self, step: int, stepped: Stepped) -> dict:
        fields, warnings = self.watch.interval()  # every rank: one small collective
        for warning in warnings:
            tqdm.write(f"warning: {warning}")
        return fields

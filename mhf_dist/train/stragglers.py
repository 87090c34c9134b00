"""Slow ranks made visible. Each rank measures its own compute time per step: the CPU seconds of its training
thread in the step (on a CPU device that thread's share of the compute, its OpenMP workers taking equal shares), which
a rank waiting in a gloo collective or for its data does not spend, so a rank that is slow itself stands out from
the ranks that wait for it, whatever the step's wall time. Background threads (the data reader's prefetch, the
heartbeat) are left out: their bursts would blur one step's figure. Every log interval one small collective gathers
each rank's mean over the interval; rank 0 logs the median, the slowest rank and its ratio to the median of the other
ranks of its pipeline stage (the stages do different work: the last one holds the decoder; one slow rank of two shows
its own slowness, not half of it), and warns, naming the rank and its node
(from its heartbeat), when the ratio exceeds ``train.straggler_factor`` for ``train.straggler_intervals`` intervals
in a row.

On GPU ranks the measure is the host's share of the step (Python, kernel launches, waits that spin): a rank starved
of CPU shows; a slow device is not told apart by it (that needs the device's own kernel times)."""

from __future__ import annotations

import statistics
import time

from mhf_dist.parallel.scalars import ScalarCollectives
from mhf_dist.storage.heartbeats import read_heartbeats
from mhf_dist.storage.run_dir import RunDir


class StragglerWatch:
    """Rank ``rank`` of ``world``'s compute times, gathered and judged every log interval."""

    def __init__(self, run: RunDir, rank: int, world: int, stage: int, factor: float, intervals: int,
                 scalars: ScalarCollectives):
        self.run, self.rank, self.world, self.factor, self.intervals = run, rank, world, factor, intervals
        self.stage = stage  # the rank's pipeline stage: ranks are compared with the others of theirs
        self.scalars = scalars
        self._seconds, self._steps = 0.0, 0
        self._slow: tuple[int, int] | None = None  # (rank, consecutive slow intervals)

    def clock(self) -> float:
        """The rank's compute clock (the calling thread's CPU seconds)."""
        return time.thread_time()

    def add(self, seconds: float) -> None:
        """One step's compute seconds."""
        self._seconds += seconds
        self._steps += 1

    def interval(self) -> tuple[dict, str | None]:
        """Every rank, at each logged step: gather the interval's means (one collective); on rank 0, the record's
        fields and a warning when a rank stayed slow; elsewhere ``({}, None)``."""
        mine = [0.0] * (2 * self.world)  # each rank's seconds, then its stage
        mine[self.rank], mine[self.world + self.rank] = self._seconds / max(1, self._steps), self.stage
        self._seconds, self._steps = 0.0, 0
        if self.world == 1:
            return {"compute_s": mine[0]}, None
        gathered = self.scalars.read(self.scalars.sum_tensor(mine))
        if self.rank != 0:
            return {}, None
        times, stages = gathered[:self.world], gathered[self.world:]
        ratios = {}
        for r, t in enumerate(times):  # against the median of the other ranks of the same stage
            peers = [u for q, u in enumerate(times) if q != r and stages[q] == stages[r]]
            if peers and (median := statistics.median(peers)) > 0:
                ratios[r] = t / median
        fields = {"compute_s": statistics.median(times)}
        if not ratios:  # no stage has two ranks to compare
            return fields, None
        slowest = max(ratios, key=ratios.get)
        ratio = ratios[slowest]
        fields |= {"slowest_rank": slowest, "slowest_ratio": ratio}
        before, self._slow = self._slow, None
        if ratio <= self.factor:
            flagged = before is not None and before[1] >= self.intervals
            return fields, f"rank {before[0]} is no longer a straggler ({ratio:.2f}x)" if flagged else None
        count = before[1] + 1 if before and before[0] == slowest else 1
        self._slow = (slowest, count)
        if count < self.intervals:
            return fields, None
        node = next((b.get("node") for b in read_heartbeats(self.run) if b["rank"] == slowest), "its node unknown")
        fields["straggler"] = {"rank": slowest, "node": node, "ratio": ratio, "intervals": count}
        if count > self.intervals:  # said once; the records and status keep showing it
            return fields, None
        return fields, (f"rank {slowest} on {node} is a straggler: its compute time per step is {ratio:.2f}x the "
                        f"median of its pipeline stage's other ranks for {count} log intervals "
                        f"(train.straggler_factor={self.factor:g})")

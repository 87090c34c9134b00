"""A run's callbacks: the monitors every run has, the test suite's injected faults, and the user's
(``train.callbacks``), in the order their hooks run."""

from __future__ import annotations

from mhf_dist.config import RunConfig
from mhf_dist.train.callbacks import Callback, installed
from mhf_dist.train.divergence import DivergenceSettings
from mhf_dist.train.divergence_watch import DivergenceWatch
from mhf_dist.train.downstream import DownstreamTasks
from mhf_dist.train.fault_injection import injected_faults
from mhf_dist.train.finite_weights import FiniteWeights
from mhf_dist.train.measures import StepMeasures
from mhf_dist.train.oom import OomWatch
from mhf_dist.train.profiler_window import ProfilerWindow
from mhf_dist.train.reporter import Reporter
from mhf_dist.train.save_clock import SaveClock
from mhf_dist.train.stragglers import Stragglers, StragglerSettings
from mhf_dist.train.watchdog import HangSettings, HangWatch


def run_callbacks(cfg: RunConfig) -> list[Callback]:
    """The callbacks of a run of ``cfg``; a ``train.callbacks`` path that names no callback is refused here."""
    t = cfg.train
    window = ProfilerWindow(t)
    return [
        # first: inside the step, as the straggler watch measures it
        *injected_faults(t.global_batch_size),
        Reporter(cfg),  # a start that W&B refuses stops before the watchdog writes a heartbeat
        # before the others' work in a phase: the phase is marked first
        HangWatch(HangSettings.of(t), profiled=window.profiles),  # a profiled step may take longer
        StepMeasures(),
        Stragglers(StragglerSettings.of(t)),
        DivergenceWatch(DivergenceSettings.of(t)),
        SaveClock(t.checkpoint_minutes),
        FiniteWeights(),
        OomWatch(),  # rank 0 says another rank's out-of-memory while it waits for that rank
        window,  # its profiler starts once the others marked the step
        # train.eval_tasks: loaded at the start, scored after the validation pass
        DownstreamTasks(t),
        *installed(t.callbacks),
    ]

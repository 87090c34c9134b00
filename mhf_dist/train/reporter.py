"""Rank 0's report of a run: each logged step's record in ``metrics.jsonl``, TensorBoard and W&B
(``MetricsLogger``) and as a console line with the ETA
(``step_line``), the progress bar, and at the start what the run reads: a mixture's
sources, a data restart's record."""

from __future__ import annotations

from tqdm.auto import tqdm

from mhf_dist.config import RunConfig
from mhf_dist.train.callbacks import Callback, RunContext, Stepped
from mhf_dist.train.console import step_line
from mhf_dist.train.metrics import MetricsLogger


class Reporter(Callback):
    """The logs and the console of the run ``cfg``: written on rank 0, the other ranks' progress bars disabled."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def on_start(self, run: RunContext) -> None:
        cfg, t, progress = self.cfg, self.cfg.train, run.progress
        self.progress, rank0 = progress, run.job.rank == 0
        self.logger = MetricsLogger(run.run, resume_step=progress.start, cfg=cfg) if rank0 else None
        if (
            self.logger and run.data_restarted
        ):  # the record at the resumed step says where the data changed
            self.logger.log(progress.start, {"data_restart": True, "data_path": run.data.name})
        if rank0:  # a mixture: each source's share and how often the run goes over it
            samples = t.max_steps * t.global_batch_size
            for line in run.data.describe(samples, samples * cfg.data.seq_len):
                tqdm.write(line)
        self.bar = tqdm(
            desc="train",
            unit="step",
            dynamic_ncols=True,
            initial=progress.start,
            total=t.max_steps,
            disable=None if rank0 else True,
        )

    def after_step(self, step: int, stepped: Stepped) -> None:
        self.bar.update()

    def on_log(self, step: int, record: dict) -> None:
        if self.logger is None:
            return
        self.logger.log(step, record)
        seconds = self.progress.step_seconds()
        left = (self.progress.end - step) * seconds if seconds is not None else None
        tqdm.write(step_line(step, self.cfg.train.max_steps, record, left))

    def after_rollback(self, step: int) -> None:
        if self.logger is not None:
            self.logger.rewind(step)  # what was logged since the checkpoint goes
        self.bar.n = step
        self.bar.refresh()

    def close(self, finished: bool) -> None:
        self.bar.close()
        if self.logger is not None:
            self.logger.close()

"""A callback of the test suite's own, installed with ``train.callbacks=["helpers.callbacks:HookRecorder"]``: every
hook the training loop calls, one line per call (``hook step``), in ``RUN/hooks-rank<N>.txt``."""

from __future__ import annotations

from mhf_dist.train.callbacks import Callback


class HookRecorder(Callback):
    def _called(self, hook: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"{hook} {self.step}\n")

    def on_start(self, run):
        self.path, self.step = run.run.path / f"hooks-rank{run.job.rank}.txt", run.progress.start
        self._called("on_start")

    def before_step(self, step):
        self.step = step
        self._called("before_step")

    def spike_limits(self):
        self._called("spike_limits")
        return None

    def wants_save(self):
        self._called("wants_save")
        return False

    def after_step(self, step, stepped):
        self._called("after_step")

    def record(self, step, stepped):
        self._called("record")
        return {}

    def before_eval(self, step):
        self._called("before_eval")

    def eval_progress(self):
        self._called("eval_progress")

    def on_log(self, step, record):
        self._called("on_log")

    def wants_rollback(self, step):
        self._called("wants_rollback")
        return False

    def on_rollback(self, step):
        self._called("on_rollback")

    def after_rollback(self, step):
        self._called("after_rollback")

    def allows_save(self, step, stepped, reason):
        self._called("allows_save")
        return True

    def before_save(self, step):
        self._called("before_save")

    def after_save(self, step, path):
        self._called("after_save")

    def on_end(self, step):
        self._called("on_end")

    def close(self, finished):
        self._called(f"close({finished})")

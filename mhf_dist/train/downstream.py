"""Downstream tasks scored inside a run (``train.eval_tasks``): ``DownstreamTasks``, the callback that loads
lm-evaluation-harness tasks at the start and scores them on the in-memory model every
``train.eval_tasks_interval`` steps and at the last, and the lm-eval model it hands lm-eval (``run_lm_class``),
whose requests the data-parallel ranks share (``score_requests``). Under ``log P_inf``, as ``export-hf`` gives lm-eval
(docs/models.md, "Downstream tasks during training"; why: docs/design-training.md, "Downstream tasks").
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mhf_dist.config import ConfigError
from mhf_dist.train.callbacks import Callback

if TYPE_CHECKING:
    from mhf_dist.backend import Trainer
    from mhf_dist.config import TrainConfig
    from mhf_dist.train.callbacks import RunContext

Request = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


def _load_local_first(names: list[str], paths: list[str]) -> dict:
    """``TaskManager.load(names)`` from ``paths`` alone when they hold every name (indexing lm-eval's own thousands
    of task configs takes seconds on every rank), else with lm-eval's tasks too (a local group may name them)."""
    from lm_eval.tasks import TaskManager

    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if all(name in local.all_tasks for name in names):
            with contextlib.suppress(Exception):
                return local.load(names)
    return TaskManager(include_path=paths or None).load(names)


def offline_datasets() -> None:
    """Tasks read local files only: the Hugging Face hub and datasets stay offline (before lm-eval imports them,
    and in an already imported ``datasets``)."""
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def load_tasks(names: list[str], paths: list[str]) -> dict:
    """lm-eval's tasks of ``names`` (``TaskManager.load``: tasks and groups), their configs also read from
    ``paths`` (as ``--include_path``); a task that does not load, or that generates text, is a ``ConfigError``."""
    offline_datasets()
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        task_dict = _load_local_first(names, paths)
    except Exception as e:  # lm-eval raises what the task's config or dataset raises
        raise ConfigError(
            f"train.eval_tasks: {names} did not load (train.eval_tasks_path {paths}): "
            f"{type(e).__name__}: {e}"
        ) from e
    tasks = task_dict["tasks"]
    generating = [name for name, t in tasks.items() if t.OUTPUT_TYPE == "generate_until"]
    if generating:
        raise ConfigError(
            f"train.eval_tasks: {generating} generate text (generate_until); a run scores loglikelihood, "
            "loglikelihood_rolling and multiple_choice tasks only"
        )
    return task_dict


def request_rows(
    requests: list[Request], seq_len: int, pad: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [rows, seq_len], targets [rows, seq_len])``: each request on a row of its own, context then
    continuation, left-truncated to ``seq_len + 1`` tokens as lm-eval's Hugging Face model truncates them,
    right-padded with ``pad``; targets -1 except at the continuation's tokens. Rows past the requests are dummies
    scoring one token."""
    inputs = torch.full((rows, seq_len), pad, dtype=torch.long)
    targets = torch.full((rows, seq_len), -1, dtype=torch.long)
    for row, (context, continuation) in enumerate(requests):
        whole = (context + continuation)[-(seq_len + 1) :]
        length, scored = len(whole) - 1, len(continuation)
        inputs[row, :length] = torch.tensor(whole[:-1])
        targets[row, length - scored : length] = torch.tensor(continuation)
    targets[len(requests) :, 0] = pad
    return inputs, targets


def score_requests(
    trainer: Trainer,
    requests: list[Request],
    *,
    dp: int,
    dp_rank: int,
    micro: int,
    seq_len: int,
    pad: int,
    progress: Callable[[], None] = lambda: None,
) -> list[tuple[float, bool]]:
    """lm-eval's ``(log-likelihood, greedy)`` of every request, on every rank: each data-parallel rank scores a
    slice, all in as many micro-batches of ``micro`` rows (``Trainer.score``: ZeRO-3 and the pipeline need the ranks
    in step), and receives the others'."""
    if not requests:
        return []
    share = math.ceil(len(requests) / dp)
    batches = math.ceil(share / micro)
    inputs, targets = request_rows(
        requests[dp_rank * share : (dp_rank + 1) * share], seq_len, pad, batches * micro
    )
    pairs = list(zip(inputs.split(micro), targets.split(micro)))
    scores = trainer.score(pairs, progress)[:, :share].reshape(-1, 3)[: len(requests)]
    return [(-float(nll), bool(top1 == count)) for nll, top1, count in scores.tolist()]


def run_lm_class() -> type:
    """An lm-eval ``TemplateLM`` over the run's model, tokenizing as lm-eval's Hugging Face model does a
    causal model (``tok_encode``, ``prefix_token_id``, ``max_length`` = ``data.seq_len``); rank 0 of world 1 to
    lm-eval, which then gathers nothing: ``score`` shares the requests out over the data-parallel ranks."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import has_bos_prefix
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class _RunLM(TemplateLM):
        def __init__(self, tokenizer, max_length: int, score: Callable[[list[Request]], list]):
            super().__init__()
            self.tokenizer, self.max_length, self.score = tokenizer, max_length, score

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return self.eot_token_id if bos is None else bos

        def tok_encode(
            self, string: str, add_special_tokens: bool | None = None, **kwargs
        ) -> list[int]:
            special = (
                {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            )
            if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)
            ):
                special["add_special_tokens"] = False
            return self.tokenizer.encode(string, **special)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            return self.score([(context, continuation) for _, context, continuation in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owners = [], []
            for i, (string,) in enumerate(req.args for req in requests):
                tokens = self.tok_encode(string)
                found = get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
                for window in map(make_disjoint_window, found):
                    windows.append(window)
                    owners.append(i)
            totals = [0.0] * len(requests)
            for owner, (logprob, _) in zip(owners, self.score(windows)):
                totals[owner] += logprob
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            raise ConfigError("train.eval_tasks: a run does not generate text (generate_until)")

    return _RunLM


def metric_fields(results: dict) -> dict:
    """lm-eval's ``results`` (``{task: {"acc,none": v, ...}}``) as ``eval/<task>/<metric>`` numbers: a metric of
    the ``none`` filter by its name, of another filter as ``<metric>,<filter>``; standard errors left out."""
    found = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            if not kept or "_stderr" in metric or isinstance(value, (str, bool)):
                continue
            if isinstance(value, (int, float)):
                found[f"eval/{task}/{metric if kept == 'none' else key}"] = value
    return found


class DownstreamTasks(Callback):
    """``train.eval_tasks``: loaded at the start (a task that does not load: ``ConfigError``, before any step),
    scored every ``train.eval_tasks_interval`` steps (default ``train.eval_interval``; 0: the last only) and at the
    last step, into the step's record as ``eval/<task>/<metric>`` with ``eval_tasks_s``; with
    ``train.eval_tasks_samples`` rank 0 writes each request's scores to ``RUN/eval/<step>/<task>.jsonl``."""

    def __init__(self, t: TrainConfig):
        self.names, self.paths = list(t.eval_tasks), list(t.eval_tasks_path)
        interval = t.eval_tasks_interval
        self.interval = t.eval_interval if interval is None else interval
        self.samples = t.eval_tasks_samples
        self.run: RunContext | None = None
        self.task_dict: dict | None = None

    def on_start(self, run: RunContext) -> None:
        if not self.names:
            return
        self.run = run
        self.task_dict = load_tasks(self.names, self.paths)

    def evaluates(self, step: int) -> bool:
        if self.task_dict is None:
            return False
        due = self.interval and step % self.interval == 0
        return bool(due) or step == self.run.progress.end

    def evaluation(self, step: int, progress: Callable[[], None]) -> dict:
        from lm_eval.evaluator import evaluate

        run, began = self.run, time.perf_counter()
        groups = run.job.groups

        def score(requests: list[Request]) -> list[tuple[float, bool]]:
            return score_requests(
                run.trainer,
                requests,
                dp=groups.dp,
                dp_rank=groups.dp_rank,
                micro=run.cfg.train.micro_batch_size,
                seq_len=run.cfg.data.seq_len,
                pad=run.assets.tokenizer.eos_token_id,
                progress=progress,
            )

        lm = run_lm_class()(run.assets.tokenizer, run.cfg.data.seq_len, score)
        out = evaluate(
            lm=lm,
            task_dict=self.task_dict,
            bootstrap_iters=0,
            log_samples=self.samples,
            verbosity="ERROR",
        )
        if self.samples and run.job.rank == 0:
            self._write_samples(step, out["samples"])
        return metric_fields(out["results"]) | {"eval_tasks_s": time.perf_counter() - began}

    def _write_samples(self, step: int, samples: dict) -> None:
        from lm_eval.utils import handle_non_serializable

        folder = self.run.run.path / "eval" / str(step)
        folder.mkdir(parents=True, exist_ok=True)
        for task, found in samples.items():
            lines = [json.dumps(s, default=handle_non_serializable) for s in found]
            (folder / f"{task}.jsonl").write_text("".join(line + "\n" for line in lines))

"""Profiler windows inside a run: ``train.profile_steps`` writes one trace per rank holding exactly the window's
steps; a ``RUN/profile-now`` file starts a window of the next steps in a running run, the same steps on every rank;
a window that is no window is refused before the start; ``status`` lists the windows; a profiled step gets the
watchdog's first-step budget; the private torch functions of the CUDA memory history are still there."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers.jobs import Job
from helpers.runs import run_cli, train_args
from mhf_dist.backend import StepStats
from mhf_dist.cli import main
from mhf_dist.cluster.status import gather, render, to_json
from mhf_dist.config import ConfigError, load_config
from mhf_dist.errors import PREEMPTED_EXIT_CODE
from mhf_dist.storage.run_dir import RunDir
from mhf_dist.train import profiler_window
from mhf_dist.train.callbacks import Callback, Callbacks, Stepped
from mhf_dist.train.profiler_window import ProfilerWindow, trigger_steps
from mhf_dist.train.watchdog import FIRST_SETTING, HANG_SETTING, HangSettings, Watchdog

STEP_MARK = re.compile(r"ProfilerStep#(\d+)")
# smaller traces to write and read: one micro-batch per rank and step, and ZeRO-1 (the Python calls of ZeRO-3's
# parameter hooks, each an event of the stacks, make a step's trace about 8 times larger)
SMALL = ("train.micro_batch_size=4", "parallel.zero_stage=1")


def traced(path: Path) -> tuple[set[int], set[str]]:
    """The steps a trace marks (``ProfilerStep#N``) and the operators recorded inside those steps."""
    events = json.loads(path.read_text())["traceEvents"]
    marks = [e for e in events if STEP_MARK.fullmatch(str(e.get("name")))]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in marks]
    inside = {
        e["name"]
        for e in events
        if e.get("cat") == "cpu_op" and any(a <= e["ts"] <= b for a, b in spans)
    }
    return {int(STEP_MARK.fullmatch(e["name"])[1]) for e in marks}, inside


@pytest.mark.multirank
def test_a_window_of_steps_writes_one_trace_per_rank_holding_those_steps_and_status_lists_it(
    tmp_path, data, capsys
):
    run = tmp_path / "run"
    out = run_cli(train_args(run, data, 2, "train.profile_steps=2-3", *SMALL, steps=4))
    folder = run / "profiles" / "step-2-3"
    assert f"profiled steps 2-3: {folder}/" in out
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank-0.pt.trace.json",
        "rank-1.pt.trace.json",
    ]
    for rank in (0, 1):
        steps, ops = traced(folder / f"rank-{rank}.pt.trace.json")
        assert steps == {2, 3}, rank  # none for steps 1 or 4
        assert {"aten::mm", "aten::embedding", "FusedHead"} <= ops, sorted(ops)
    events = json.loads((folder / "rank-0.pt.trace.json").read_text())["traceEvents"]
    assert any(e["name"] == "aten::mm" and e["args"].get("Input Dims") for e in events)  # shapes
    assert any(e.get("cat") == "python_function" for e in events)  # Python stacks

    text = render(gather(run))
    assert f"profile    steps 2-3: 2 traces in {folder}" in text
    (window,) = json.loads(to_json(gather(run)))["profiles"]
    assert window == {
        "name": "step-2-3",
        "path": str(folder),
        "first_step": 2,
        "last_step": 3,
        "traces": ["rank-0.pt.trace.json", "rank-1.pt.trace.json"],
        "memory_snapshots": [],
    }


@pytest.mark.multirank
def test_a_file_starts_a_window_of_the_next_steps_on_every_rank_of_a_running_run(tmp_path, data):
    run = tmp_path / "run"
    job = Job(train_args(run, data, 2, *SMALL, steps=10_000), tmp_path / "job.log")
    job.wait_for("step 2/")
    seen = max(int(n) for n in re.findall(r"step (\d+)/10000", job.output))
    (run / "profile-now").write_text("2\n")
    job.wait_for("profiled steps")
    job.ctrl_c()
    code, out = job.end()
    assert code == PREEMPTED_EXIT_CODE, out[-3000:]
    assert f"{run / 'profile-now'}: profiling the next 2 steps" in out
    assert not (run / "profile-now").exists()  # it fires once
    (folder,) = (run / "profiles").iterdir()
    first, last = map(int, re.fullmatch(r"step-(\d+)-(\d+)", folder.name).groups())
    # read at the end of a step after the touch: the window begins after the next step at the earliest
    assert last == first + 1 and first >= seen + 2, (seen, folder.name)
    for rank in (0, 1):
        steps, ops = traced(folder / f"rank-{rank}.pt.trace.json")
        assert steps == {first, last} and "aten::mm" in ops, rank


def test_a_window_that_is_no_window_is_refused_before_the_start(tmp_path, data):
    run = tmp_path / "run"
    out = run_cli(train_args(run, data, 2, "train.profile_steps=5-2"), expect_rc=2, timeout=120)
    assert "train.profile_steps: '5-2' is not a window of steps: give FIRST-LAST" in out, out
    assert "Traceback" not in out and not run.exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.profile_steps=0-2", "'0-2' is not a window of steps"),
        ("train.profile_steps=3-", "'3-' is not a window of steps"),
        ("train.profile_steps=every", "'every' is not a window of steps"),
        ("train.profile_steps=201-202", "profile_steps=201-202 begins after train.max_steps=200"),
        ("train.profile_ranks=[0,-1]", "train.profile_ranks: [0, -1] names a negative rank"),
        ("train.profile_window=0", "train.profile_window: Input should be greater than or equal"),
    ],
)
def test_bad_profiling_settings_name_the_field(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny-h4b16k", overrides=["train.max_steps=200", override])


def test_a_window_reads_as_its_first_and_last_step():
    train = load_config(
        "tiny-h4b16k", overrides=["train.profile_steps=7", "train.profile_ranks=1"]
    ).train
    assert (train.profile_steps, train.profiled_steps, train.profile_ranks) == ("7-7", (7, 7), [1])
    assert load_config(
        "tiny-h4b16k", overrides=["train.profile_steps= 2 - 4"]
    ).train.profiled_steps == (
        2,
        4,
    )


def test_the_file_may_hold_a_number_of_steps():
    assert trigger_steps("", 3) == (3, None) and trigger_steps(" 5\n", 3) == (5, None)
    assert trigger_steps("0", 3)[0] == 3 and trigger_steps("lots", 3) == (
        3,
        "holds 'lots', not a number of steps",
    )


class FakeRecording:
    """A ``Recording`` that records nothing: what each rank began, ended and wrote."""

    log: list = []

    def __init__(self, device):
        self.log.append("start")

    def begin(self, step):
        self.log.append(("begin", step))

    def end(self):
        self.log.append("end")

    def finish(self, folder, rank):
        self.log.append(("finish", folder.name, rank))
        return [folder / f"rank-{rank}.pt.trace.json"]


def test_ranks_agree_on_a_window_only_rank_0_asked_for(tmp_path, monkeypatch):
    """Two ranks' windows, their flags agreed as the step's read agrees them: the file rank 0 finds at the end of
    step 3 makes steps 4-5 a window on both, the configured 7-7 another; rank 1 records none (profile_ranks)."""
    monkeypatch.setattr(profiler_window, "Recording", FakeRecording)
    FakeRecording.log = []
    run = RunDir(tmp_path)
    train = load_config(
        "tiny-h4b16k", overrides=["train.profile_steps=7", "train.profile_ranks=[0]"]
    ).train
    ranks = [ProfilerWindow(train), ProfilerWindow(train)]
    for rank, window in enumerate(ranks):
        job = SimpleNamespace(rank=rank, world=2, device=torch.device("cpu"))
        window.on_start(SimpleNamespace(run=run, job=job))
    profiled = {0: [], 1: []}
    for step in range(1, 10):
        for rank, window in enumerate(ranks):
            window.before_step(step)
            if window.profiles(step):
                profiled[rank].append(step)
        if step == 3:
            run.profile_trigger.write_text("2")
        agreed = any([w.flag() for w in ranks])
        for window in ranks:
            window.flag_agreed(step, agreed)
            window.after_step(step, None)
    assert profiled == {0: [4, 5, 7], 1: [4, 5, 7]} and not run.profile_trigger.exists()
    assert FakeRecording.log == [
        *("start", ("begin", 4), "end", ("begin", 5), "end", ("finish", "step-4-5", 0)),
        *("start", ("begin", 7), "end", ("finish", "step-7-7", 0)),
    ]


def test_a_window_cut_short_is_written_and_one_that_cannot_be_leaves_the_run_going(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(profiler_window, "Recording", FakeRecording)
    FakeRecording.log = []
    train = load_config("tiny-h4b16k", overrides=["train.profile_steps=3-6"]).train
    window = ProfilerWindow(train)
    job = SimpleNamespace(rank=0, world=1, device=torch.device("cpu"))
    window.on_start(SimpleNamespace(run=RunDir(tmp_path), job=job))
    for step in (1, 2, 3, 4):
        window.before_step(step)
        window.flag_agreed(step, window.flag())
        window.after_step(step, None)
    window.before_step(5)  # the step fails: the run closes
    window.close(False)
    assert FakeRecording.log[-2:] == [("begin", 5), ("finish", "step-3-5", 0)]

    def fails(folder, rank):
        raise OSError(28, "No space left on device")

    window.before_step(6)
    monkeypatch.setattr(window.recording, "finish", fails)
    window.on_end(6)
    assert window.recording is None and window.first is None
    assert "warning: rank 0's profile of steps 6-6 was not written: [Errno 28] No space left" in (
        capsys.readouterr().err
    )


class Flagging(Callback):
    def __init__(self, raise_it: bool):
        self.raise_it, self.told = raise_it, None

    def flag(self):
        return self.raise_it

    def flag_agreed(self, step, raised):
        self.told = (step, raised)


def test_the_callbacks_flags_ride_after_their_save_requests_in_the_steps_flags():
    class Saving(Flagging):
        save_reason = "mine"

        def wants_save(self):
            return True

    first, second = Saving(False), Flagging(True)
    callbacks = Callbacks([first, second])
    assert callbacks.wants_save() == [True, False, False, True]
    stop, *wanted = flags = [
        False,
        True,
        False,
        False,
        True,
    ]  # as the loop asks and the ranks agree them
    assert callbacks.save_reason(wanted) == "mine"
    callbacks.after_step(6, Stepped(StepStats(1.0, [], None, flags=flags), 1e-3, 0.1))
    assert (first.told, second.told) == ((6, False), (6, True))


def test_a_profiled_step_gets_the_first_step_budget(tmp_path):
    watchdog = Watchdog(RunDir(tmp_path), 0, HangSettings(10, None, 100))
    watchdog.mark(1, "step")  # a start's first step
    watchdog.mark(2, "step")
    assert (watchdog._phase.budget_s, watchdog._phase.setting) == (10, HANG_SETTING)
    watchdog.mark(3, "step", longer=True)
    assert (watchdog._phase.budget_s, watchdog._phase.setting) == (100, FIRST_SETTING)


def test_status_lists_each_window_with_its_ranks_files(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in (
        "step-12-14/rank-10.pt.trace.json",
        "step-12-14/rank-2.pt.trace.json",
        "step-12-14/memory-rank-2.pickle",
        "step-12-14/memory-rank-10.pickle",
        "step-12-14/rank-3.pt.trace.json.partial",  # still being written
        "step-5-5/rank-0.pt.trace.json",
        "notes/rank-0.pt.trace.json",
    ):
        (run / "profiles" / name).parent.mkdir(parents=True, exist_ok=True)
        (run / "profiles" / name).write_text("{}")
    assert main(["status", str(run)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "profiles" in line]
    assert lines == [
        f"profile    step 5: 1 trace in {run / 'profiles' / 'step-5-5'}",
        f"           steps 12-14: 2 traces, 2 memory snapshots in {run / 'profiles' / 'step-12-14'}",
    ]
    assert main(["status", str(run), "--json"]) == 0
    windows = json.loads(capsys.readouterr().out)["profiles"]
    assert [(w["name"], w["traces"], w["memory_snapshots"]) for w in windows] == [
        ("step-5-5", ["rank-0.pt.trace.json"], []),
        (
            "step-12-14",
            ["rank-2.pt.trace.json", "rank-10.pt.trace.json"],
            ["memory-rank-2.pickle", "memory-rank-10.pickle"],
        ),
    ]


def test_the_cuda_memory_history_functions_are_still_in_torch():
    """``torch.cuda.memory._record_memory_history`` and ``_dump_snapshot`` are private: used by
    mhf_dist/train/profiler_window.py (``start_memory_history``, ``dump_memory_history``) with these parameters."""
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "stacks", "max_entries", "device"} <= set(record), list(record)
    dump = inspect.signature(torch.cuda.memory._dump_snapshot).parameters
    assert list(dump)[:1] == ["filename"], list(dump)

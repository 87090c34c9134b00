"""``tools/gpu_check.sh --cpu``: the main job end to end at tiny sizes (train, resume, tp=2, accumulation,
document-masking and profiler-window runs, export, generate, eval, profile), its summary table and its JSON report;
the verdicts of the resume, layout and feature checks on made-up runs; what tells a gloo limitation from a defect;
that the GPU mode's commands parse and their configs validate (they run only on a GPU); what the check needs of its
machine (no git) and how it shares it (threads per process, one compiling run); that its CPU commands, forked from
one server, run as fresh interpreters would; the report a check leaves when it is cut short; and that a profile row's
memory is its steps' own peak."""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mhf_dist.commands import gpu_check
from mhf_dist.commands.gpu_check import feature_checks, runner, training
from mhf_dist.commands.gpu_check import report as reporting

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = [
    "build",
    "sdpa",
    "train-standard",
    "resume-fp32",
    "layout-tp2-gloo",
    "grad-accum",
    "profiler-window",
    "document-masking",
    "export-hf",
    "generate-cli",
    "generate-mhf",
    "generate-standard",
    "generate-ratio",
    "eval-perplexity",
    "profile-tiny-standard",
    "profile-tiny-h4b16k",
    "profile-tiny-ratio",
    "profile-tiny-head",
    "reference-tiny",
]


def _run_args(monkeypatch, out: Path) -> argparse.Namespace:
    """``gpu-check --cpu --out OUT``'s arguments, for ``run`` in this process; what it sets in the environment is
    set here first, so that it is undone after the test."""
    for name, value in (
        ("CUDA_VISIBLE_DEVICES", ""),
        ("DS_ACCELERATOR", "cpu"),
        ("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR", "unused")),
    ):
        monkeypatch.setenv(name, value)
    return argparse.Namespace(cpu=True, out=str(out), work=None, nominal_tflops=989.0, skip="")


@pytest.mark.multirank
@pytest.mark.longest
def test_cpu_mode_runs_every_step_and_reports_every_check(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == EXPECTED
    for check in checks.values():
        assert check["status"] in ("PASS", "measured"), check
        assert check["values"], check
        assert all(math.isfinite(v) for v in check["values"].values()), check
    assert report["passed"] and report["mode"] == "cpu"
    assert report["torch"] and report["deepspeed"] != "not installed" and report["date"]

    resume = checks["resume-fp32"]["values"]
    assert resume["max_abs_diff"] == 0 and resume["steps_compared"] == 4
    assert checks["eval-perplexity"]["values"]["rel_diff_nll"] <= 1e-4
    masking = checks["document-masking"]["values"]  # the masked run is not the unmasked one
    assert (
        max(masking["unmasked_max_rel_diff_loss"], masking["unmasked_max_rel_diff_grad_norm"])
        > 1e-4
    )
    # profiling changed no number (the CPU's fp32 steps are deterministic) and wrote no memory history there
    window = checks["profiler-window"]
    assert window["values"]["max_rel_diff_loss"] == 0 and "memory_allocs" not in window["values"]
    assert window["values"]["step_2_s"] > 0 and window["values"]["step_3_s"] > 0, window
    assert "the trace marks steps 2-3" in window["result"], window
    for name in (
        "layout-tp2-gloo",
        "grad-accum",
    ):  # the loss and the gradient norm were both compared
        assert {"max_rel_diff_loss", "max_rel_diff_grad_norm"} <= checks[name]["values"].keys(), (
            checks[name]
        )
    assert "CPU build" in checks["build"]["result"] and "fp32 " in checks["sdpa"]["result"]
    reference = checks["reference-tiny"][
        "values"
    ]  # Standard against transformers' Qwen3, side by side
    assert {"standard_over_reference_128x2", "reference_tokens_per_s_128x2"} <= reference.keys()

    table = (tmp_path / "gpu_check.md").read_text()
    assert "| check | result | status |" in table and table in proc.stdout  # the table was printed
    for name in EXPECTED:
        assert f"| {name} |" in table
    for step in (
        "preflight",
        "training: resume, layouts, features",
        "export, generation, evaluation",
        "throughput",
    ):
        assert f"{step} done in" in proc.stdout
    assert report["complete"] and [s["status"] for s in report["steps"]] == ["done"] * 4
    # the plan, first
    assert "estimated" in proc.stdout and "A command is stopped at 600 s" in proc.stdout
    # every command's seconds, printed and in the JSON
    commands = {c["command"]: c for c in report["commands"]}
    assert {
        "train-standard",
        "train-mhf-fp32-resume",
        "train-layout-tp2-gloo",
        "train-document-masking",
        "train-profiler-window",
        "status-profiler-window",
        "eval",
        "profile-tiny",
        "reference-tiny",
    } <= set(commands)
    for name, command in commands.items():
        assert command["status"] == "done" and command["seconds"] > 0, command
        assert f"  {name}: done in " in proc.stdout


def _fake_runs(ctx, whole_losses, resumed_losses, resume_line):
    for name, losses in (("mhf-fp32", whole_losses), ("mhf-fp32-resumed", resumed_losses)):
        ctx.run(name).mkdir(parents=True)
        (ctx.run(name) / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses)
            )
        )
    ctx.logs.mkdir(parents=True)
    (ctx.logs / "train-mhf-fp32-resume.log").write_text(resume_line)


def test_resume_check_fails_on_any_difference_or_a_fresh_start(tmp_path):
    losses = [38.9, 38.7, 38.6, 38.5, 38.3, 38.0, 37.6, 37.2]
    cases = {
        "equal": (losses, "resumed from RUN/checkpoints/step-00000004 at step 4\n", "PASS"),
        "one ulp": (
            losses[:-1] + [math.nextafter(losses[-1], 0)],
            "resumed from X at step 4\n",
            "FAIL",
        ),
        "started afresh": (losses, "step 1 | loss 38.9\n", "FAIL"),
        "step missing": (losses[:-1], "resumed from X at step 4\n", "FAIL"),
    }
    for case, (resumed, log, expected) in cases.items():
        ctx = runner.Context(runner.CPU, tmp_path / case, tmp_path / case / "work", 989.0)
        _fake_runs(ctx, losses, resumed, log)
        assert ctx.mode.resume_tolerance["fp32"] == 0
        assert training.resume_check(ctx, "fp32").status == expected, case


def _write_run(run, records, preset="tiny-h4b16k"):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text(f"preset: {preset}\n")


def _records(steps=4, loss=38.9, grad_norm=100.0, **extra):
    return [
        {
            "step": s,
            "loss": loss - 0.1 * s,
            "head_losses": [(loss - 0.1 * s) / 4] * 4,
            "grad_norm": grad_norm / s,
            "tokens_per_s": 1000.0,
            "memory_gb": 1.0,
            "device_s": 1e-3,
            **extra,
        }
        for s in range(1, steps + 1)
    ]


def test_layout_and_accumulation_checks_compare_loss_and_gradient_norm(tmp_path):
    ctx = runner.Context(runner.CPU, tmp_path, tmp_path / "work", 989.0)
    _write_run(ctx.run("mhf-fp32"), _records(steps=8))
    cases = {  # run records: expected status
        "equal": (_records(), "PASS"),
        "loss within 1e-4": ([r | {"loss": r["loss"] * (1 + 5e-5)} for r in _records()], "PASS"),
        "gradient norm off by 1e-3": (
            [r | {"grad_norm": r["grad_norm"] * (1 + 1e-3)} for r in _records()],
            "FAIL",
        ),
        "step missing": (_records(steps=3), "FAIL"),
        "loss not falling": ([r | {"loss": 38.9} for r in _records()], "FAIL"),
        "loss not finite": (
            [r | {"loss": math.nan} if r["step"] == 2 else r for r in _records()],
            "FAIL",
        ),
    }
    for case, (records, expected) in cases.items():
        _write_run(ctx.run("grad-accum"), records)
        check = feature_checks.grad_accum_check(ctx)
        assert check.status == expected, (case, check)
    # the preset's micro-batch is 8
    assert "global batch 8 = 4 micro-batches of 2" not in check.result
    assert "global batch 8 = 1 micro-batches of 8" in check.result


def test_feature_checks_on_made_up_runs(tmp_path, monkeypatch):
    ctx = runner.Context(runner.GPU, tmp_path, tmp_path / "work", 989.0)
    c, weight = ctx.mode.compare_steps, feature_checks.P_INF_WEIGHT

    _write_run(ctx.run("engram-device"), _records(c, memory_gb=0.30))
    _write_run(ctx.run("engram-offload"), _records(c, memory_gb=0.10))
    check = feature_checks.engram_offload_check(ctx)
    assert check.status == "PASS" and check.values["device_probe_s"] == 1e-3, check
    # the tables stayed on the device
    _write_run(ctx.run("engram-offload"), _records(c, memory_gb=0.30))
    assert feature_checks.engram_offload_check(ctx).status == "FAIL"
    _write_run(
        ctx.run("engram-offload"),
        [{k: v for k, v in r.items() if k != "device_s"} for r in _records(c, memory_gb=0.10)],
    )
    # on a GPU every compared step carries the device probe's time
    check = feature_checks.engram_offload_check(ctx)
    assert check.status == "FAIL" and "the device probe timed no step" in check.result, check
    # the sharded tables' run, against its own device run
    _write_run(ctx.run("engram-sharded-device"), _records(c, memory_gb=0.30))
    _write_run(ctx.run("engram-sharded"), _records(c, memory_gb=0.10))
    check = feature_checks.engram_offload_check(ctx, "engram-sharded")
    assert check.status == "PASS" and check.name == "engram-sharded", check
    assert "sharded host tables against device tables" in check.result
    _write_run(ctx.run("engram-sharded"), _records(c, memory_gb=0.30))
    assert feature_checks.engram_offload_check(ctx, "engram-sharded").status == "FAIL"

    _write_run(ctx.run("mhf-bf16"), _records(30))

    def p_inf(records):
        _write_run(ctx.run("p-inf-tp2-bf16"), records)
        return feature_checks.p_inf_check(ctx).status

    good = [r | {"p_inf_loss": 8.0 - 0.1 * r["step"]} for r in _records(c)]
    good = [r | {"loss": sum(r["head_losses"]) + weight * r["p_inf_loss"]} for r in good]
    assert p_inf(good) == "PASS"
    # the term is missing
    assert p_inf([r | {"loss": sum(r["head_losses"])} for r in good]) == "FAIL"
    assert (
        p_inf([r | {"head_losses": [h * 1.05 for h in r["head_losses"]]} for r in good]) == "FAIL"
    )  # step 1
    flat = [r | {"p_inf_loss": 8.0, "loss": sum(r["head_losses"]) + weight * 8.0} for r in good]
    assert p_inf(flat) == "FAIL"  # the term does not fall
    assert p_inf([{k: v for k, v in r.items() if k != "p_inf_loss"} for r in good]) == "FAIL"

    _write_run(ctx.run("mhf-fp32"), _records(30))
    _write_run(ctx.run("compile"), _records(c))
    check = feature_checks.compile_check(ctx)
    assert check.status == "PASS" and check.values["first_step_s"] > 0, check

    # the masked run against the same run on the CPU and against the unmasked mhf-fp32
    masked = [
        r | {"grad_norm": r["grad_norm"] * 1.03} if r["step"] >= 4 else r for r in _records(c)
    ]
    reference = [{k: v for k, v in r.items() if k != "device_s"} for r in masked]

    def masking(records, cpu=reference, mode=ctx):
        _write_run(mode.run("document-masking"), records)
        _write_run(mode.run("document-masking-cpu"), cpu)
        return feature_checks.feature_check(
            mode, runner.Job("document-masking", [], required=False), None
        )

    check = masking(masked)
    assert check.status == "PASS", check
    assert check.values["max_rel_diff_grad_norm"] == 0 and check.values["device_probe_s"] == 1e-3
    assert check.values["unmasked_max_rel_diff_grad_norm"] == pytest.approx(0.03), check
    assert (
        "against document-masking-cpu" in check.result
        and "against the unmasked mhf-fp32" in check.result
    )
    # the unmasked run's numbers: the masking took no effect
    check = masking(_records(c), cpu=_records(c))
    assert check.status == "FAIL" and "the masking took no effect" in check.result, check
    # the device's masked run is not the CPU's
    assert masking([r | {"loss": r["loss"] * (1 + 1e-3)} for r in masked]).status == "FAIL"
    nan = [r | {"loss": math.nan} if r["step"] == 2 else r for r in masked]
    assert masking(nan, cpu=nan).status == "FAIL"  # not finite, on both devices alike
    assert masking(masked[:-1]).status == "FAIL"  # a step missing
    # with --cpu the run is its own reference: no CPU run, its loss finite and falling, the masking in effect
    cpu = runner.Context(runner.CPU, tmp_path / "cpu", tmp_path / "cpu" / "work", 989.0)
    _write_run(cpu.run("mhf-fp32"), _records(8))
    masked = masked[: cpu.mode.compare_steps]
    check = masking(masked, cpu=[], mode=cpu)
    assert check.status == "PASS" and "max_rel_diff_loss" not in check.values, check
    assert check.values["unmasked_max_rel_diff_grad_norm"] == pytest.approx(0.03), check
    assert masking(_records(4), cpu=[], mode=cpu).status == "FAIL"
    assert masking(nan[:4], cpu=[], mode=cpu).status == "FAIL"
    assert masking([r | {"loss": 38.9} for r in masked], cpu=[], mode=cpu).status == "FAIL"

    # the profiler window of steps 2-3: its trace, on a GPU its kernels and memory history, status, the losses
    def step(n, ts, dur, cat="user_annotation"):
        return {"ph": "X", "cat": cat, "name": f"ProfilerStep#{n}", "ts": ts, "dur": dur}

    def kernel(ts, dur=5.0):
        return {"ph": "X", "cat": "kernel", "name": "ampere_sgemm", "ts": ts, "dur": dur}

    trace = [
        step(2, 1000.0, 400.0),
        step(3, 1500.0, 300.0),
        step(2, 1010.0, 420.0, "gpu_user_annotation"),  # the device runs behind the host
        step(3, 1510.0, 320.0, "gpu_user_annotation"),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1020.0, "dur": 10.0},
        kernel(1030.0),
        kernel(1820.0),  # ends as the last step does on the device
    ]
    ours = {"filename": "/site-packages/mhf_dist/model/lm.py", "line": 80, "name": "forward"}
    theirs = {
        "filename": "/site-packages/torch/nn/modules/linear.py",
        "line": 125,
        "name": "forward",
    }
    history = {
        "segments": [{"address": 0, "total_size": 2**21}],
        "device_traces": [
            [
                {"action": "segment_alloc", "addr": 0, "size": 2**21, "frames": [ours]},
                {"action": "alloc", "addr": 0, "size": 512, "frames": [theirs, ours]},
                {"action": "free_requested", "addr": 0, "size": 512, "frames": [ours]},
            ]
        ],
    }
    timed = [r | {"step_s": 0.1} for r in _records(30)]
    timed = [r | {"step_s": 0.3} if r["step"] in (2, 3) else r for r in timed]

    def window(records=timed, events=trace, memory=history, mode=ctx):
        run = mode.run("profiler-window")
        _write_run(run, records[: mode.mode.compare_steps])
        folder = run / "profiles" / "step-2-3"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        if events is not None:
            (folder / "rank-0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
        if memory is not None:
            (folder / "memory-rank-0.pickle").write_bytes(pickle.dumps(memory))
        mode.logs.mkdir(parents=True, exist_ok=True)
        return feature_checks.feature_check(
            mode, runner.Job("profiler-window", [], required=False), None
        )

    check = window()  # status --json run as the check runs it
    assert check.status == "PASS", check
    assert check.values["kernels"] == 2 and check.values["memory_allocs_mhf_dist"] == 1, check
    assert (check.values["step_2_s"], check.values["step_3_s"]) == (0.3, 0.3), check
    assert check.values["unprofiled_step_s"] == 0.1 and check.values["max_rel_diff_loss"] == 0
    assert "status-profiler-window" in [c["command"] for c in ctx.commands]

    def status_here(ctx, name, args, *rest, **options):  # the command's output, without a process
        from mhf_dist.cluster.run_status import gather
        from mhf_dist.cluster.status import to_json

        assert args[:2] == ["status", "--json"], args
        return to_json(gather(args[2]))

    monkeypatch.setattr(runner, "mhf_dist", status_here)
    assert window().status == "PASS"
    assert window([r | {"loss": r["loss"] * (1 + 1e-6)} for r in timed]).status == "PASS"
    failing = {
        "a step more": trace + [step(4, 1900.0, 50.0)],
        "a step less": [e for e in trace if e.get("name") != "ProfilerStep#3"],
        "no step markers": [e for e in trace if "ProfilerStep" not in e["name"]],
        "no kernels": [e for e in trace if e["cat"] != "kernel"],
        "a kernel before the window": trace + [kernel(900.0)],
        "a kernel after the window": trace + [kernel(1828.0)],
        "no trace": None,
    }
    for case, events in failing.items():
        check = window(events=events)
        assert check.status == "FAIL", (case, check)
    check = window(events=trace[:-1] + [kernel(2000.0)])
    assert "1 of its 2 CUDA kernels lie outside the profiled steps" in check.result, check
    (ctx.run("profiler-window") / "profiles" / "step-2-3" / "rank-0.pt.trace.json").write_text("{")
    assert feature_checks.trace_findings(
        ctx.run("profiler-window") / "profiles" / "step-2-3" / "rank-0.pt.trace.json", True
    )[0][0].startswith("rank-0.pt.trace.json does not parse")
    check = window(memory=None)  # no memory history on a GPU: status lists none either
    assert check.status == "FAIL" and "no memory-rank-0.pickle" in check.result, check
    assert "status --json lists" in check.result, check
    only_torch = history | {
        "device_traces": [
            [
                e | {"frames": [theirs]}
                for e in history["device_traces"][0]
                if e["action"] == "alloc"
            ]
        ]
    }
    for case, memory in {
        "no allocation of ours": only_torch,
        "no segments": {k: v for k, v in history.items() if k != "segments"},
        "no device traces": {k: v for k, v in history.items() if k != "device_traces"},
        "no allocation": history | {"device_traces": [[]]},
    }.items():
        assert window(memory=memory).status == "FAIL", case
    run = ctx.run("profiler-window")
    (run / "profiles" / "step-2-3" / "memory-rank-0.pickle").write_bytes(b"not a pickle")
    assert feature_checks.memory_findings(run / "profiles" / "step-2-3" / "memory-rank-0.pickle")[
        0
    ][0].startswith("memory-rank-0.pickle does not load")
    # profiling changed the numbers
    check = window([r | {"loss": r["loss"] * (1 + 1e-4)} if r["step"] == 3 else r for r in timed])
    assert check.status == "FAIL" and "losses are not mhf-fp32's" in check.result, check
    assert window(timed[:5]).status == "FAIL"  # a step missing
    # with --cpu: no kernels and no memory history expected, and a memory history written is wrong
    host = [e for e in trace if e["cat"] in ("user_annotation", "cpu_op")]
    check = window(events=host, memory=None, mode=cpu)
    assert check.status == "PASS" and "kernels" not in check.values, check
    assert window(events=host, memory=history, mode=cpu).status == "FAIL"
    assert window(events=host[1:], memory=None, mode=cpu).status == "FAIL"  # step 2 unmarked

    out = ctx.work / "profile-tp2-gloo"
    out.mkdir(parents=True)
    row = {
        "size": "100m",
        "hash": "h4b16k",
        "layout": "tp=2",
        "dtype": "bf16",
        "seq_len": 512,
        "tokens_per_s": 9e3,
        "step_s": 0.05,
        "comm_s": 0.01,
        "comm_bytes_per_step": 2**24,
        "memory_gb": 3.0,
    }
    (out / "profile.json").write_text(json.dumps({"training": [row]}))
    assert feature_checks.profile_tp2_check(ctx).status == "measured"
    (out / "profile.json").write_text(json.dumps({"training": [row | {"comm_bytes_per_step": 0}]}))
    # no tensor-parallel traffic: not tp=2
    assert feature_checks.profile_tp2_check(ctx).status == "FAIL"

    (out / "profile.json").unlink()  # results that cannot be read fail their own row, not the step
    check = feature_checks.feature_check(
        ctx, runner.Job("profile-tp2-gloo", [], required=False, ranks=2), None
    )
    assert (
        check.status == "FAIL" and "reading its results failed: FileNotFoundError" in check.result
    )


GLOO_LOGS = {  # a failed 2-rank run's log: is it a gloo limitation?
    "RuntimeError: ProcessGroupGloo::reduce: unsupported device type cuda": True,
    "RuntimeError: Backend gloo does not support reduce_scatter_tensor_coalesced": True,
    (
        '  File "/venv/torch/distributed/distributed_c10d.py", line 2810, in all_reduce\n'
        "    work = group.allreduce([tensor], opts)\n           ^^^^^^^^^^^^^^^^^^\n"
        "RuntimeError: Invalid scalar type"
    ): True,
    (
        "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Write to [127.0.0.1]:41234 "
        "failed: Bad address"
    ): True,
    (
        "Fatal Python error: Segmentation fault\n\nThread 0x00007f (most recent call first):\n"
        '  File "/venv/torch/distributed/distributed_c10d.py", line 2431 in recv\n'
        '  File "/venv/deepspeed/runtime/pipe/p2p.py", line 80 in recv\n'
    ): True,
    "torch.AcceleratorError: CUDA error: invalid device ordinal": False,
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": False,
    "RuntimeError: Invalid scalar type": False,  # not from a collective
    (
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):\n"
        '  File "/work/mhf_dist/model/engram.py", line 80 in forward\n'
    ): False,
    "gloo: connection closed by peer after rank 1 exited": False,
}


def test_a_gloo_limitation_is_told_from_a_defect_by_the_error_text(tmp_path):
    for text, limitation in GLOO_LOGS.items():
        assert (
            feature_checks.gloo_limitation(f"step 1 | loss 38.9\n{text}\n") is not None
        ) == limitation, text
    log = tmp_path / "train-layout-pp2-gloo.log"
    log.write_text("RuntimeError: ProcessGroupGloo::reduce: unsupported device type cuda\n")
    error = runner.StepFailed("train-layout-pp2-gloo exited 1", log)
    two_ranks = runner.Job("layout-pp2-gloo", [], required=False, ranks=2)
    check = feature_checks.failed_run_check(two_ranks, error)
    assert check.status == runner.NOT_RUNNABLE and "unsupported device type cuda" in check.result
    one_rank = runner.Job("compile", [], required=False)
    # one rank uses no gloo collective
    assert feature_checks.failed_run_check(one_rank, error).status == "FAIL"
    log.write_text("torch.AcceleratorError: CUDA error: invalid device ordinal\n")
    assert feature_checks.failed_run_check(two_ranks, error).status == "FAIL"
    env = {
        "date": "d",
        "commit": "c",
        "device": "H200",
        "torch": "2",
        "build": "CUDA 12",
        "deepspeed": "0",
        "transformers": "5",
    }
    steps = len(gpu_check.STEPS)
    table = reporting.markdown(runner.GPU, env, [check], 1.0, steps, steps)
    assert "all passed (not runnable with gloo: layout-pp2-gloo)" in table


def test_gpu_mode_commands_parse_and_their_configs_validate(tmp_path):
    """The GPU mode's layout and feature commands run only on a GPU: here their arguments go through the CLI's
    parser and their configs through validation and the layout preflight, as ``mhf-dist`` would before any rank
    starts."""
    from mhf_dist.cli import build_parser
    from mhf_dist.config import load_config
    from mhf_dist.train.preflight import preflight

    ctx = runner.Context(runner.GPU, tmp_path, tmp_path / "work", 989.0)
    jobs = training.training_jobs(ctx, tmp_path, 80)
    names = [job.name for job in jobs if not job.required]
    assert names == [
        "compile",
        "engram-offload",
        "engram-sharded",
        "layout-tp2-gloo",
        "layout-pp2-gloo",
        "grad-accum",
        "profiler-window",
        "document-masking",
        "p-inf-tp2-bf16",
        "profile-tp2-gloo",
    ]
    assert len(jobs) <= ctx.mode.jobs  # all side by side
    skipped = runner.Context(
        runner.without(runner.GPU, {"compile", "layout-pp2-gloo"}),
        tmp_path,
        tmp_path / "work",
        989.0,
    )
    assert [
        job.name for job in training.training_jobs(skipped, tmp_path, 80) if not job.required
    ] == [
        "engram-offload",
        "engram-sharded",
        "layout-tp2-gloo",
        "grad-accum",
        "profiler-window",
        "document-masking",
        "p-inf-tp2-bf16",
        "profile-tp2-gloo",
    ]
    with pytest.raises(ValueError, match="--skip resume-fp32: not a layout or feature run"):
        runner.without(runner.GPU, {"resume-fp32"})
    for job in jobs:
        for name, argv in job.commands:
            args = build_parser().parse_args(argv)
            assert ("train.dist_backend=gloo" in args.overrides) == (job.ranks > 1), name
            if args.command == "profile":
                assert args.layout == "tp=2" and args.size == "100m", name
                continue
            cfg = load_config(args.preset, overrides=args.overrides)
            # the masked run's reference trains on the CPU
            device = "cpu" if name == "train-document-masking-cpu" else "cuda"
            preflight(cfg, args.nproc_per_node or 1, device, data_here=False)
            assert (args.nproc_per_node or 1) == job.ranks and cfg.train.device == device, name
            if job.name in ("grad-accum", "engram-offload"):
                assert cfg.train.global_batch_size > cfg.train.micro_batch_size, name
            assert cfg.data.document_masking == (job.name == "document-masking"), name
            # only the profiler-window run profiles, a window inside the steps it compares
            profiled = feature_checks.PROFILED if job.name == "profiler-window" else None
            assert cfg.train.profiled_steps == profiled, name
            if profiled:
                assert cfg.train.stop_at_step == ctx.mode.compare_steps >= profiled[1], name
                assert (cfg.train.dtype, args.preset) == ("fp32", "tiny-h4b16k"), name
    # the CPU mode's compared steps hold the window too
    assert runner.CPU.compare_steps >= feature_checks.PROFILED[1]
    assert "profiler-window" in runner.CPU.features
    masking = next(job for job in jobs if job.name == "document-masking")
    on_gpu, on_cpu = (
        load_config(args.preset, overrides=args.overrides).model_dump()
        for args in (build_parser().parse_args(argv) for _, argv in masking.commands)
    )
    # the same masked run, on the GPU and on the CPU
    assert on_gpu["train"].pop("device") == "cuda" and on_cpu["train"].pop("device") == "cpu"
    assert on_gpu == on_cpu


def test_the_check_runs_without_git_and_names_its_commit(tmp_path, monkeypatch):
    """git is optional: where it is missing (a container, a copied tree) or fails, the commit comes from the package's
    metadata, and the check gets past its start (``run`` with its steps replaced, in this process)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no git, nothing else either
    env = reporting.environment(runner.CPU)
    version = importlib.metadata.version("mhf-dist")
    assert (
        env["commit"] in ("unknown", f"unknown (mhf-dist {version})") or len(env["commit"]) == 12
    ), env
    assert env["date"] and env["torch"] and env["device"].startswith("CPU")

    failing = tmp_path / "failing-git"  # a git that cannot read the tree
    failing.mkdir()
    (failing / "git").write_text("#!/bin/sh\necho 'fatal: not a git repository' >&2\nexit 128\n")
    (failing / "git").chmod(0o755)
    monkeypatch.setenv("PATH", str(failing))
    assert reporting.source_commit() == env["commit"]

    class Installed:  # an install from the repository: pip recorded the commit (PEP 610)
        version = "0.1.0"

        @staticmethod
        def read_text(name):
            return json.dumps(
                {
                    "url": "https://example.org/mhf-dist.git",
                    "vcs_info": {
                        "vcs": "git",
                        "commit_id": "0123456789abcdef0123456789abcdef01234567",
                    },
                }
            )

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Installed)
    assert reporting.source_commit() == "0123456789ab"

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    ran = []
    monkeypatch.setattr(gpu_check, "STEPS", (("one", lambda ctx: ran.append(1) or []),))
    assert gpu_check.run(_run_args(monkeypatch, tmp_path / "out")) == 0 and ran == [1]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["complete"] and report["commit"] == "0123456789ab"


def test_with_git_the_commit_is_the_checkouts():
    if (
        not (runner.ROOT / ".git").exists()
        or subprocess.run(["git", "--version"], capture_output=True).returncode
    ):
        pytest.skip("not a checkout, or no git")
    head = subprocess.run(
        ["git", "-C", str(runner.ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert reporting.source_commit() == head


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_check_cut_short_leaves_a_report_of_the_steps_that_ended(tmp_path, monkeypatch, signum):
    """The report is on disk after every step: cut short in the second step (Ctrl-C, or SIGTERM as a machine's time
    limit sends it) while its jobs run side by side, its JSON and table name the first step as ended and the check
    as incomplete, the command under way is ended with it and its seconds recorded, and the third step never
    runs."""
    started, start = [], runner.Context.start

    def sleeper(ctx, name, cmd, env):
        started.append(start(ctx, name, [sys.executable, "-c", "import time; time.sleep(60)"], env))
        return started[-1]

    def second(ctx):
        threading.Timer(1.0, os.kill, (os.getpid(), signum)).start()
        runner.run_jobs(ctx, [runner.Job("sleeper", [("sleeper", ["--version"])])])
        pytest.fail("the signal did not interrupt the step")

    monkeypatch.setattr(runner.Context, "start", sleeper)
    monkeypatch.setattr(
        gpu_check,
        "STEPS",
        (
            ("first", lambda ctx: [runner.Check("first-check", runner.PASS, "fine", {"x": 1.0})]),
            ("second", second),
            ("third", lambda ctx: pytest.fail("ran after the interruption")),
        ),
    )
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # a handler of the process's own: the check interrupts anyway
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(SystemExit if signum == signal.SIGTERM else KeyboardInterrupt):
            gpu_check.run(_run_args(monkeypatch, tmp_path))
        assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[signal.SIGINT])

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not report["complete"]
    assert [(s["step"], s["status"]) for s in report["steps"]] == [
        ("first", "done"),
        ("second", "interrupted"),
    ]
    assert [c["name"] for c in report["checks"]] == ["first-check"]
    assert [(c["command"], c["status"]) for c in report["commands"]] == [("sleeper", "interrupted")]
    assert report["commands"][0]["seconds"] >= 0.5
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| first-check |" in table and "in progress: 1 of 3 steps finished" in table
    # the command under way ended with the check
    assert started[0].wait(timeout=10) == -signal.SIGKILL
    assert not list(tmp_path.glob("*.tmp"))


def test_the_report_is_rewritten_after_every_command(tmp_path, monkeypatch):
    """Within a step too: a check killed (SIGKILL) between two commands still has the first one's seconds on disk.
    Each command gets the OpenMP threads it is given (every core when it runs alone)."""
    ctx = runner.Context(runner.CPU, tmp_path, tmp_path / "work", 989.0)
    ctx.logs.mkdir(parents=True)
    env = {
        "date": "d",
        "commit": "c",
        "device": "CPU",
        "torch": "2",
        "build": "CPU build",
        "deepspeed": "0",
        "transformers": "5",
    }
    report = reporting.Report(ctx, env, len(gpu_check.STEPS))
    report.write([], [])
    start = ctx.start

    def threads_printed(name, cmd, env):  # the command prints the OMP_NUM_THREADS it was given
        return start(
            name, [sys.executable, "-c", "import os; print(os.environ['OMP_NUM_THREADS'])"], env
        )

    monkeypatch.setattr(ctx, "start", threads_printed)
    assert runner.mhf_dist(ctx, "first", ["--version"], threads=3).strip() == "3"
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(c["command"], c["status"]) for c in on_disk["commands"]] == [("first", "done")]
    assert on_disk["commands"][0]["seconds"] > 0 and not on_disk["complete"]
    assert runner.mhf_dist(ctx, "alone", ["--version"]).strip() == str(ctx.cores)


def _alive(pid: int) -> bool:
    try:  # a zombie has ended too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cpu_commands_fork_from_a_server_and_run_as_fresh_interpreters(tmp_path):
    """With ``--cpu`` the commands (``mhf-dist`` and scripts) fork from a server that has imported torch: each still
    gets its environment, its OpenMP threads and a session of its own, its output and exit code come back, and one
    past its time limit is killed with the processes it started."""
    ctx = runner.Context(runner.CPU, tmp_path, tmp_path / "work", 989.0)
    ctx.logs.mkdir(parents=True)
    assert runner.mhf_dist(ctx, "version", ["--version"]).startswith("mhf-dist ")
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "forked = 'torch' in sys.modules\n"
        "import torch\n"
        "print(forked, os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), os.getsid(0) == os.getpid())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    assert runner.python(ctx, "threads", [str(script), "0"], threads=1).split() == [
        "True",
        "1",
        "1",
        "True",
    ]
    with pytest.raises(runner.StepFailed, match="exited 3"):
        runner.python(ctx, "failing", [str(script), "3"])
    assert "to stderr" in (ctx.logs / "failing.log").read_text()
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid)\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(runner.StepFailed, match="stopped at its time limit of 3 s"):
        runner.python(ctx, "sleeper", [str(sleeper)], timeout_s=3)
    child = int((ctx.logs / "sleeper.log").read_text().splitlines()[1])
    for _ in range(50):  # killed with the command's group; its new parent reaps it
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)
    assert [(c["command"], c["status"]) for c in ctx.commands] == [
        ("version", "done"),
        ("threads", "done"),
        ("failing", "failed"),
        ("sleeper", "failed"),
    ]


@pytest.mark.parametrize("cores", [2, 16, 64])
def test_step_2_takes_no_more_threads_than_there_are_cores(tmp_path, cores):
    """Every job of step 2 at once on a GPU (a 2-rank job is 2 processes, each given the count as it is), two jobs
    at a time with ``--cpu``: the OpenMP threads of the processes that run at once add up to at most the cores (or one
    each, where there are more processes than cores)."""
    for mode in (runner.GPU, runner.CPU):
        ctx = runner.Context(mode, tmp_path, tmp_path / "work", 989.0)
        ctx.cores = cores
        jobs = training.training_jobs(ctx, tmp_path, 80)
        threads = runner.threads_per_process(ctx, jobs)
        assert all(n >= 1 for n in threads.values())
        if mode.jobs >= len(jobs):  # all side by side
            assert sum(job.ranks for job in jobs) == 18
        for together in itertools.combinations(
            jobs, min(mode.jobs, len(jobs))
        ):  # any jobs that run at once
            processes = sum(job.ranks for job in together)
            assert sum(job.ranks * threads[job.name] for job in together) <= max(cores, processes)


def test_in_step_2_only_the_compile_run_compiles(tmp_path):
    """The runs side by side run the fused head eagerly (``auto`` would compile it in every CUDA run at once); only
    ``compile`` compiles, its blocks and its fused head, against those eager runs."""
    from mhf_dist.cli import build_parser
    from mhf_dist.config import load_config

    ctx = runner.Context(runner.GPU, tmp_path, tmp_path / "work", 989.0)
    commands = [
        (job.name, argv)
        for job in training.training_jobs(ctx, tmp_path, 80)
        for _, argv in job.commands
    ]
    commands.append(
        ("standard", training.train_args(ctx, ctx.run("standard"), "tiny-standard", "fp32"))
    )
    compiling = []
    for job, argv in commands:
        args = build_parser().parse_args(argv)
        preset = args.preset if args.command == "train" else f"{args.size}-{args.hash}"
        train = load_config(preset, overrides=args.overrides).train
        if train.compile or train.fused_head_kernel != "eager":
            compiling.append((job, train.compile, train.fused_head_kernel))
    assert compiling == [("compile", True, "compiled")]
    plan = gpu_check.plan(runner.GPU)  # printed at the start: the estimate and the limits
    assert (
        "estimated 9.2 min in all" in plan and "stopped at 300 s (a 2-rank run's at 180 s)" in plan
    )
    # the docstring's, README's and usage's "9 minutes"
    assert round(sum(runner.GPU.estimates_s) / 60) == 9


def test_a_profile_rows_memory_is_its_steps_own_peak():
    """What the process held before the steps (here 1 GiB, as a peak-FLOPs matmul in the same process would) is not
    in the row's memory: the peak restarts after the model is built."""
    import torch

    from mhf_dist.profiling.training import profile_training
    from mhf_dist.train.throughput import host_peak_bytes, reset_host_peak

    if not reset_host_peak():
        pytest.skip(
            "the kernel refuses to restart the peak resident memory (/proc/self/clear_refs)"
        )
    probe = torch.ones(2**28)  # 1 GiB, resident
    del probe
    before = host_peak_bytes() / 2**30
    row = profile_training(
        size="tiny",
        hash_name="h4b16k",
        tp=1,
        steps=1,
        warmup=0,
        seq_len=16,
        micro=1,
        dtype="fp32",
        device=torch.device("cpu"),
        peak_measured=1e12,
        peak_nominal=None,
        overrides=[],
    )
    assert 0 < row.memory_gb < before - 0.5, (row.memory_gb, before)

"""``tools/gpu_check.sh --cpu``: the main job end to end at tiny sizes (train, resume, tp=2 and accumulation runs,
export, generate, eval, profile), its summary table and its JSON report; the verdicts of the resume, layout and
feature checks on made-up runs; what tells a gloo limitation from a defect; and that the GPU mode's commands parse
and their configs validate (they run only on a GPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ["build", "sdpa", "train-standard", "resume-fp32", "layout-tp2-gloo", "grad-accum", "export-hf",
            "generate-cli", "generate-mhf", "generate-standard", "generate-ratio", "eval-perplexity",
            "profile-tiny-standard", "profile-tiny-h4b16k", "profile-tiny-ratio", "profile-tiny-head"]


def _gpu_check():
    from mhf_dist.commands import gpu_check

    return gpu_check


@pytest.mark.multirank
def test_cpu_mode_runs_every_step_and_reports_every_check(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200, env=os.environ | {"PYTHONUNBUFFERED": "1"})
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
    for name in ("layout-tp2-gloo", "grad-accum"):  # the loss and the gradient norm were both compared
        assert {"max_rel_diff_loss", "max_rel_diff_grad_norm"} <= checks[name]["values"].keys(), checks[name]
    assert "CPU build" in checks["build"]["result"] and "fp32 " in checks["sdpa"]["result"]

    table = (tmp_path / "gpu_check.md").read_text()
    assert "| check | result | status |" in table and table in proc.stdout  # the table was printed
    for name in EXPECTED:
        assert f"| {name} |" in table
    for step in ("preflight", "training: resume, layouts, features", "export, generation, evaluation", "throughput"):
        assert f"{step} done in" in proc.stdout


def _fake_runs(ctx, whole_losses, resumed_losses, resume_line):
    for name, losses in (("mhf-fp32", whole_losses), ("mhf-fp32-resumed", resumed_losses)):
        ctx.run(name).mkdir(parents=True)
        (ctx.run(name) / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": i + 1, "loss": loss}) + "\n" for i, loss in enumerate(losses)))
    ctx.logs.mkdir(parents=True)
    (ctx.logs / "train-mhf-fp32-resume.log").write_text(resume_line)


def test_resume_check_fails_on_any_difference_or_a_fresh_start(tmp_path):
    gpu_check = _gpu_check()
    losses = [38.9, 38.7, 38.6, 38.5, 38.3, 38.0, 37.6, 37.2]
    cases = {
        "equal": (losses, "resumed from RUN/checkpoints/step-00000004 at step 4\n", "PASS"),
        "one ulp": (losses[:-1] + [math.nextafter(losses[-1], 0)], "resumed from X at step 4\n", "FAIL"),
        "started afresh": (losses, "step 1 | loss 38.9\n", "FAIL"),
        "step missing": (losses[:-1], "resumed from X at step 4\n", "FAIL"),
    }
    for case, (resumed, log, expected) in cases.items():
        ctx = gpu_check.Context(gpu_check.CPU, tmp_path / case, tmp_path / case / "work", 989.0)
        _fake_runs(ctx, losses, resumed, log)
        assert ctx.mode.resume_tolerance["fp32"] == 0
        assert gpu_check.resume_check(ctx, "fp32").status == expected, case


def _write_run(run, records, preset="tiny-h4b16k"):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "config.yaml").write_text(f"preset: {preset}\n")


def _records(steps=4, loss=38.9, grad_norm=100.0, **extra):
    return [{"step": s, "loss": loss - 0.1 * s, "head_losses": [(loss - 0.1 * s) / 4] * 4, "grad_norm": grad_norm / s,
             "tokens_per_s": 1000.0, "memory_gb": 1.0, **extra} for s in range(1, steps + 1)]


def test_layout_and_accumulation_checks_compare_loss_and_gradient_norm(tmp_path):
    gpu_check = _gpu_check()
    ctx = gpu_check.Context(gpu_check.CPU, tmp_path, tmp_path / "work", 989.0)
    _write_run(ctx.run("mhf-fp32"), _records(steps=8))
    cases = {  # run records: expected status
        "equal": (_records(), "PASS"),
        "loss within 1e-4": ([r | {"loss": r["loss"] * (1 + 5e-5)} for r in _records()], "PASS"),
        "gradient norm off by 1e-3": ([r | {"grad_norm": r["grad_norm"] * (1 + 1e-3)} for r in _records()], "FAIL"),
        "step missing": (_records(steps=3), "FAIL"),
        "loss not falling": ([r | {"loss": 38.9} for r in _records()], "FAIL"),
        "loss not finite": ([r | {"loss": math.nan} if r["step"] == 2 else r for r in _records()], "FAIL"),
    }
    for case, (records, expected) in cases.items():
        _write_run(ctx.run("grad-accum"), records)
        check = gpu_check.grad_accum_check(ctx)
        assert check.status == expected, (case, check)
    assert "global batch 8 = 4 micro-batches of 2" not in check.result  # the preset's micro-batch is 8
    assert "global batch 8 = 1 micro-batches of 8" in check.result


def test_feature_checks_on_made_up_runs(tmp_path):
    gpu_check = _gpu_check()
    ctx = gpu_check.Context(gpu_check.GPU, tmp_path, tmp_path / "work", 989.0)
    c, weight = ctx.mode.compare_steps, gpu_check.P_INF_WEIGHT

    _write_run(ctx.run("engram-device"), _records(c, memory_gb=0.30))
    _write_run(ctx.run("engram-offload"), _records(c, memory_gb=0.10))
    assert gpu_check.engram_offload_check(ctx).status == "PASS"
    _write_run(ctx.run("engram-offload"), _records(c, memory_gb=0.30))  # the tables stayed on the device
    assert gpu_check.engram_offload_check(ctx).status == "FAIL"

    _write_run(ctx.run("mhf-bf16"), _records(30))

    def p_inf(records):
        _write_run(ctx.run("p-inf-tp2-bf16"), records)
        return gpu_check.p_inf_check(ctx).status

    good = [r | {"p_inf_loss": 8.0 - 0.1 * r["step"]} for r in _records(c)]
    good = [r | {"loss": sum(r["head_losses"]) + weight * r["p_inf_loss"]} for r in good]
    assert p_inf(good) == "PASS"
    assert p_inf([r | {"loss": sum(r["head_losses"])} for r in good]) == "FAIL"  # the term is missing
    assert p_inf([r | {"head_losses": [h * 1.05 for h in r["head_losses"]]} for r in good]) == "FAIL"  # step 1
    flat = [r | {"p_inf_loss": 8.0, "loss": sum(r["head_losses"]) + weight * 8.0} for r in good]
    assert p_inf(flat) == "FAIL"  # the term does not fall
    assert p_inf([{k: v for k, v in r.items() if k != "p_inf_loss"} for r in good]) == "FAIL"

    _write_run(ctx.run("mhf-fp32"), _records(30))
    _write_run(ctx.run("compile"), _records(c))
    check = gpu_check.compile_check(ctx)
    assert check.status == "PASS" and check.values["first_step_s"] > 0, check

    out = ctx.work / "profile-tp2-gloo"
    out.mkdir(parents=True)
    row = {"size": "100m", "hash": "h4b16k", "layout": "tp=2", "dtype": "bf16", "seq_len": 512, "tokens_per_s": 9e3,
           "step_s": 0.05, "comm_s": 0.01, "comm_bytes_per_step": 2**24, "memory_gb": 3.0}
    (out / "profile.json").write_text(json.dumps({"training": [row]}))
    assert gpu_check.profile_tp2_check(ctx).status == "measured"
    (out / "profile.json").write_text(json.dumps({"training": [row | {"comm_bytes_per_step": 0}]}))
    assert gpu_check.profile_tp2_check(ctx).status == "FAIL"  # no tensor-parallel traffic: not tp=2

    (out / "profile.json").unlink()  # results that cannot be read fail their own row, not the step
    check = gpu_check.feature_check(ctx, gpu_check.Job("profile-tp2-gloo", [], required=False, ranks=2), None)
    assert check.status == "FAIL" and "reading its results failed: FileNotFoundError" in check.result


GLOO_LOGS = {  # a failed 2-rank run's log: is it a gloo limitation?
    "RuntimeError: ProcessGroupGloo::reduce: unsupported device type cuda": True,
    "RuntimeError: Backend gloo does not support reduce_scatter_tensor_coalesced": True,
    ('  File "/venv/torch/distributed/distributed_c10d.py", line 2810, in all_reduce\n'
     "    work = group.allreduce([tensor], opts)\n           ^^^^^^^^^^^^^^^^^^\n"
     "RuntimeError: Invalid scalar type"): True,
    ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Write to [127.0.0.1]:41234 "
     "failed: Bad address"): True,
    ("Fatal Python error: Segmentation fault\n\nThread 0x00007f (most recent call first):\n"
     '  File "/venv/torch/distributed/distributed_c10d.py", line 2431 in recv\n'
     '  File "/venv/deepspeed/runtime/pipe/p2p.py", line 80 in recv\n'): True,
    "torch.AcceleratorError: CUDA error: invalid device ordinal": False,
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB": False,
    "RuntimeError: Invalid scalar type": False,  # not from a collective
    ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):\n"
     '  File "/work/mhf_dist/model/engram.py", line 80 in forward\n'): False,
    "gloo: connection closed by peer after rank 1 exited": False,
}


def test_a_gloo_limitation_is_told_from_a_defect_by_the_error_text(tmp_path):
    gpu_check = _gpu_check()
    for text, limitation in GLOO_LOGS.items():
        assert (gpu_check.gloo_limitation(f"step 1 | loss 38.9\n{text}\n") is not None) == limitation, text
    log = tmp_path / "train-layout-pp2-gloo.log"
    log.write_text("RuntimeError: ProcessGroupGloo::reduce: unsupported device type cuda\n")
    error = gpu_check.StepFailed("train-layout-pp2-gloo exited 1", log)
    two_ranks = gpu_check.Job("layout-pp2-gloo", [], required=False, ranks=2)
    check = gpu_check.failed_run_check(two_ranks, error)
    assert check.status == gpu_check.NOT_RUNNABLE and "unsupported device type cuda" in check.result
    one_rank = gpu_check.Job("compile", [], required=False)
    assert gpu_check.failed_run_check(one_rank, error).status == "FAIL"  # one rank uses no gloo collective
    log.write_text("torch.AcceleratorError: CUDA error: invalid device ordinal\n")
    assert gpu_check.failed_run_check(two_ranks, error).status == "FAIL"
    table = gpu_check.markdown(gpu_check.GPU, {"date": "d", "commit": "c", "device": "H200", "torch": "2", "build":
                                               "CUDA 12", "deepspeed": "0", "transformers": "5"},
                               [check], 1.0, len(gpu_check.STEPS))
    assert "all passed (not runnable with gloo: layout-pp2-gloo)" in table


def test_gpu_mode_commands_parse_and_their_configs_validate(tmp_path):
    """The GPU mode's layout and feature commands run only on a GPU: here their arguments go through the CLI's
    parser and their configs through validation and the layout preflight, as ``mhf-dist`` would before any rank
    starts."""
    from mhf_dist.cli import build_parser
    from mhf_dist.config import load_config
    from mhf_dist.parallel.layout import preflight

    gpu_check = _gpu_check()
    ctx = gpu_check.Context(gpu_check.GPU, tmp_path, tmp_path / "work", 989.0)
    jobs = gpu_check.training_jobs(ctx, tmp_path, 80)
    names = [job.name for job in jobs if not job.required]
    assert names == ["compile", "engram-offload", "layout-tp2-gloo", "layout-pp2-gloo", "grad-accum",
                     "p-inf-tp2-bf16", "profile-tp2-gloo"]
    assert len(jobs) <= ctx.mode.jobs  # all side by side
    skipped = gpu_check.Context(gpu_check.without(gpu_check.GPU, {"compile", "layout-pp2-gloo"}), tmp_path,
                                tmp_path / "work", 989.0)
    assert [job.name for job in gpu_check.training_jobs(skipped, tmp_path, 80) if not job.required] == [
        "engram-offload", "layout-tp2-gloo", "grad-accum", "p-inf-tp2-bf16", "profile-tp2-gloo"]
    with pytest.raises(ValueError, match="--skip resume-fp32: not a layout or feature run"):
        gpu_check.without(gpu_check.GPU, {"resume-fp32"})
    for job in jobs:
        for name, argv in job.commands:
            args = build_parser().parse_args(argv)
            assert ("train.dist_backend=gloo" in args.overrides) == (job.ranks > 1), name
            if args.command == "profile":
                assert args.layout == "tp=2" and args.size == "100m", name
                continue
            cfg = load_config(args.preset, overrides=args.overrides)
            preflight(cfg, args.nproc_per_node or 1, "cuda", data_here=False)
            assert (args.nproc_per_node or 1) == job.ranks and cfg.train.device == "cuda", name
            if job.name in ("grad-accum", "engram-offload"):
                assert cfg.train.global_batch_size > cfg.train.micro_batch_size, name

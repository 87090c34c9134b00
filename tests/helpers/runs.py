"""Run `mhf-dist` in a subprocess (training initialises torch.distributed, which a test process must not keep)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RUN_CACHE: Path | None = None  # where train_run keeps this test run's finished fresh runs (tests/conftest.py sets it)


def run_cli(args: list[str], expect_rc: int = 0, timeout: int = 600) -> str:
    """``python -m mhf_dist ARGS``; asserts the exit code and returns stdout + stderr."""
    proc = subprocess.run([sys.executable, "-m", "mhf_dist", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect_rc, f"exit {proc.returncode} (expected {expect_rc}):\n{out[-5000:]}"
    return out


def train_args(run: Path, data: dict, nproc: int, *overrides: str, preset: str = "tiny-h4b16k",
               steps: int = 3) -> list[str]:
    """`mhf-dist train` arguments for a tiny run on the shared test shards (fp32, 8 sequences of 64 per step)."""
    args = ["train", "--preset", preset, "--nproc-per-node", str(nproc), "--run-dir", str(run)]
    for o in (f"tokenizer.path={data['tokenizer']}", f"data.path={data['shards']}", "data.seq_len=64",
              "model.hash.num_buckets=256", f"train.max_steps={steps}", "train.log_interval=1",
              "train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_sequences=8", *overrides):
        args += ["--set", o]
    return args


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def train_run(tmp_path: Path, data: dict, name: str, nproc: int, *overrides: str, preset: str = "tiny-h4b16k",
              steps: int = 3) -> list[dict]:
    """Train to the end (or stop_at_step) in ``tmp_path/name``; returns its metrics records.

    A fresh run (``tmp_path/name`` does not exist yet) that this test run has already trained with the same arguments
    and fault-injection settings is copied from :data:`RUN_CACHE` instead of trained again: the runs are
    deterministic, so the copy is the files the training would write. A run into an existing directory (a resume)
    always trains."""
    run = tmp_path / name
    args = train_args(run, data, nproc, *overrides, preset=preset, steps=steps)
    if run.exists() or RUN_CACHE is None:
        run_cli(args)
        return metrics(run)
    injected = sorted((k, v) for k, v in os.environ.items() if k.startswith(("MHF_DIST_", "SLURM_")))
    key = json.dumps([[a for a in args if a != str(run)], injected])
    cached = RUN_CACHE / hashlib.sha256(key.encode()).hexdigest()[:20]
    if cached.exists():
        shutil.copytree(cached, run, symlinks=True)
    else:
        run_cli(args)
        shutil.copytree(run, cached.with_suffix(".partial"), symlinks=True)
        cached.with_suffix(".partial").rename(cached)
    return metrics(run)


def trained_model(run: Path):
    """A run's newest checkpoint as our LanguageModel (eval mode), with its tokenizer and signature table."""
    from mhf_dist.model import build_model
    from mhf_dist.train.trained_weights import trained_weights
    from mhf_dist.vocab.signatures import SignatureTable
    from mhf_dist.vocab.tokenizers import load_tokenizer

    tw = trained_weights(run)
    tokenizer = load_tokenizer(tw.run.tokenizer_source(tw.cfg))
    table = SignatureTable.load(tw.run.signatures_dir) if tw.cfg.model.variant == "mhf" else None
    model = build_model(tw.cfg.model, len(tokenizer), table.codes if table else None)
    model.load_state_dict(tw.state)
    return model.eval(), tokenizer, table


def checkpoint_size_estimate(run: Path) -> tuple[int, int]:
    """(the size ``plan`` estimates for a checkpoint of ``run``'s config and layout, the size of its newest one)."""
    import yaml

    from mhf_dist.config import RunConfig
    from mhf_dist.storage.run_dir import RunDir
    from mhf_dist.train.checkpoint import checkpoint_bytes
    from mhf_dist.train.checkpoint_index import complete_checkpoints, read_marker
    from mhf_dist.train.job_estimates import checkpoint_bytes as estimated_bytes
    from mhf_dist.vocab.tokenizers import load_tokenizer

    cfg = RunConfig.model_validate(yaml.safe_load((run / "config.yaml").read_text()))
    newest = complete_checkpoints(run / "checkpoints")[-1]
    pp = read_marker(newest)["layout"]["pp"]
    vocab_size = len(load_tokenizer(RunDir(run).tokenizer_source(cfg)))
    return estimated_bytes(cfg, pp, vocab_size), checkpoint_bytes(newest)

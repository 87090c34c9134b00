"""Benchmark: checkpoints in object storage (``train.checkpoint_dir=s3://...``): how fast a save's files upload, and
how long training stalls per save.

Usage: python tools/bench_checkpoint_upload.py [--parts upload,stall] [--preset 100m-h4b16k] [--rounds 5]
           [--checkpoint DIR] [--modes sync,async-bucket] [--saves 3] [--interval 5] [--seq-len 32] [--micro 1]
           [--nproc 1] [--stall-rounds 1] [--out FILE]

Both parts use moto's S3 server on 127.0.0.1 (``moto[server]``, the dev extra), started by the tool in a process of its
own (in the tool's process it would share the interpreter lock with the uploads it serves), and reached as users'
runs reach theirs: ``AWS_ENDPOINT_URL``, dummy credentials, no proxies, no instance metadata.

1. ``upload``: one rank's files of a checkpoint of ``--preset`` (a one-step `mhf-dist train` on one rank, set up as
   tools/bench_checkpoint_stall.py's runs; or ``--checkpoint DIR``, a step directory saved before), all but
   complete.json, uploaded in ``--rounds`` rounds, each round both ways (which goes first alternates):
   ``RemoteStore.upload``, what each rank of a save does (``put_file`` per file, side by side), and a plain s3fs ``put``
   of the same files (all at once) to the same endpoint. Each upload goes to a prefix of its own, which is checked to
   hold every byte and then deleted, untimed. After the first read the files come from the page cache: the rates are
   the uploads', not the disk's. Reported: each way's median MB/s, and the median of the rounds' ratios
   (``RemoteStore`` / s3fs: within a round, a drifting machine slows both alike) with their range.
2. ``stall``: one `mhf-dist train` run (bench_checkpoint_stall's: ``--saves`` saves ``--interval`` steps apart)
   per mode of ``--modes`` and round of ``--stall-rounds``, the modes in turn: ``sync`` (RUN/checkpoints),
   ``async`` (``train.checkpoint_async``, RUN/checkpoints), ``sync-bucket`` and ``async-bucket`` (the same with
   ``train.checkpoint_dir`` in the bucket and ``train.checkpoint_staging`` a local directory). A save's stall is the
   time the training loop spent in it, as the run's ``saved ...`` line reports it, in tenths of a second
   (metrics.jsonl holds no checkpoint times); an asynchronous save's counts any wait for the save before, so
   ``--interval`` steps should outlast a save's background time (a note says when they did not). The server shares
   the machine with training: during a background upload its work slows the steps, as a remote endpoint's would
   not. Reported per mode: the median stall, the stalls, the median background time and the median stall over
   ``sync``'s. A mode whose run fails (a setting it refuses) is reported with its error and left out; the tool then
   exits with 1.
The output is markdown for docs/benchmarks-runs.md: the date, the command, the machine (cores, CPU model, load), the
versions of s3fs, moto and torch, then a table per part.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# this script's folder is first on sys.path: its runs are set up as bench_checkpoint_stall's
from bench_checkpoint_stall import saves_in, train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
# the environment the tests give their processes for the same kind of server
from helpers.s3 import s3_environment  # noqa: E402, I001
from tqdm.auto import tqdm  # noqa: E402

BUCKET = "bench-checkpoints"
WAYS = ("store", "s3fs")
WAY_NAMES = {
    "store": "`RemoteStore.upload` (`put_file` per file, side by side)",
    "s3fs": "s3fs `put` of the same files",
}
MODES = {  # mode: (train.checkpoint_async, in the bucket), name
    "sync": ((False, False), "synchronous, RUN/checkpoints"),
    "async": ((True, False), "`train.checkpoint_async`, RUN/checkpoints"),
    "sync-bucket": ((False, True), "synchronous, `s3://` (staging, upload)"),
    "async-bucket": ((True, True), "`train.checkpoint_async`, `s3://` (staging, upload)"),
}
# moto's server in a process of its own: it prints its endpoint, then serves until its stdin closes
SERVER = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("http://%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()
server.stop()
"""


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3 server on 127.0.0.1 with the empty bucket ``BUCKET``, this process's environment pointed at it;
    yields that environment (for the runs)."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    saved = dict(os.environ)
    try:
        endpoint = server.stdout.readline().strip()
        if not endpoint:
            raise SystemExit("moto's S3 server did not start (see above)")
        os.environ.clear()
        os.environ.update(s3_environment(endpoint))
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
        yield dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def failure(done: subprocess.CompletedProcess) -> str:
    """The line of a failed run's output that says why (its last ``error`` line, else its last line)."""
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    errors = [line for line in lines if line.lower().startswith("error") or "Error:" in line]
    return (errors or lines or [f"exit status {done.returncode}"])[-1]


# ------------------------------------------------------------------ 1. upload
def make_checkpoint(directory: Path, args) -> Path:
    """The step directory of a one-step run of ``args.preset`` on one rank."""
    one = argparse.Namespace(**vars(args) | {"saves": 1, "interval": 1, "nproc": 1})
    done = train(directory, one)
    saves = saves_in(done.stdout)
    if done.returncode or not saves:
        raise SystemExit(f"the checkpoint's run failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return Path(saves[-1].where)


def upload_seconds(way: str, path: Path, files: list[Path], prefix: str) -> float:
    """Seconds ``way`` takes to upload ``files`` of the checkpoint ``path`` to ``s3://BUCKET/prefix/<name>/``."""
    import fsspec

    from mhf_dist.train.checkpoint.store import RemoteStore

    if way == "store":
        store = RemoteStore(f"s3://{BUCKET}/{prefix}", path.parent)
        began = time.perf_counter()
        error = store.upload(path, files)
        seconds = time.perf_counter() - began
        if error is not None:
            raise SystemExit(error)
        return seconds
    fs = fsspec.filesystem("s3")
    targets = [f"{BUCKET}/{prefix}/{path.name}/{f.relative_to(path).as_posix()}" for f in files]
    began = time.perf_counter()
    fs.put([str(f) for f in files], targets)
    return time.perf_counter() - began


def measure_upload(path: Path, args) -> dict:
    """Part 1: ``args.rounds`` rounds of both ways' uploads of the checkpoint ``path``."""
    import fsspec

    from mhf_dist.train.checkpoint.index import MARKER

    files = sorted(f for f in path.rglob("*") if f.is_file() and f.name != MARKER)
    size = sum(f.stat().st_size for f in files)
    fs = fsspec.filesystem("s3")
    seconds = {way: [] for way in WAYS}
    for r in tqdm(range(args.rounds), desc="upload rounds", unit="round"):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            prefix = f"upload-{r}-{way}"
            seconds[way].append(upload_seconds(way, path, files, prefix))
            fs.invalidate_cache()
            if (stored := fs.du(f"{BUCKET}/{prefix}")) != size:
                raise SystemExit(f"{way} left {stored} bytes in the bucket, not {size}")
            fs.rm(f"{BUCKET}/{prefix}", recursive=True)
    rates = {way: [size / 1e6 / s for s in seconds[way]] for way in WAYS}
    ratios = [store / s3fs for store, s3fs in zip(rates["store"], rates["s3fs"])]
    return {
        "checkpoint": str(path),
        "files": len(files),
        "bytes": size,
        "seconds": seconds,
        "mb_per_s": rates,
        "median_mb_per_s": {way: statistics.median(rates[way]) for way in WAYS},
        "ratios": ratios,
        "ratio": statistics.median(ratios),
    }


# ------------------------------------------------------------------ 2. stall
def run_stall(directory: Path, mode: str, n: int, args, env: dict[str, str]) -> dict:
    """One training run of ``mode``: its saves' stalls and background times, its median step; ``error`` when it
    failed."""
    import fsspec

    from mhf_dist.train.metrics import read_metrics

    (asynchronous, bucket), _ = MODES[mode]
    run, prefix = directory / f"{mode}-{n}", f"stall-{mode}-{n}"
    overrides = [f"train.checkpoint_async={str(asynchronous).lower()}"]
    if bucket:
        overrides += [
            f"train.checkpoint_dir=s3://{BUCKET}/{prefix}",
            f"train.checkpoint_staging={directory / f'{mode}-{n}-staging'}",
        ]
    done = train(run, args, *overrides, env=env)
    saves = saves_in(done.stdout)
    found = {"mode": mode, "saves": len(saves)}
    if done.returncode or len(saves) != args.saves:
        found["error"] = failure(done) if done.returncode else f"{len(saves)} saves logged"
    else:
        steps = [r["step_s"] for r in read_metrics(run) if "step_s" in r and r["step"] > 1]
        found |= {
            "stalls": [s.stall for s in saves],
            "background": [s.background for s in saves if s.background is not None],
            "bytes": saves[-1].size,
            "step_s": statistics.median(steps) if steps else None,
        }
    shutil.rmtree(run, ignore_errors=True)
    shutil.rmtree(directory / f"{mode}-{n}-staging", ignore_errors=True)
    if bucket:
        fs = fsspec.filesystem("s3")
        fs.invalidate_cache()
        if fs.exists(f"{BUCKET}/{prefix}"):
            fs.rm(f"{BUCKET}/{prefix}", recursive=True)
    return found


def measure_stall(directory: Path, args, env: dict[str, str]) -> dict:
    """Part 2: ``args.stall_rounds`` rounds of one run per mode."""
    runs = []
    for n in tqdm(range(args.stall_rounds * len(args.modes)), desc="training runs", unit="run"):
        mode = args.modes[n % len(args.modes)]
        if any(r["mode"] == mode and "error" in r for r in runs):
            continue  # refused once: refused again
        runs.append(run_stall(directory, mode, n, args, env))
    modes = {}
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        if errors := [r["error"] for r in mine if "error" in r]:
            modes[mode] = {"error": errors[0]}
            continue
        stalls = [s for r in mine for s in r["stalls"]]
        background = [b for r in mine for b in r["background"]]
        steps = [r["step_s"] for r in mine if r["step_s"] is not None]
        modes[mode] = {
            "stalls": stalls,
            "median_stall": statistics.median(stalls),
            "background": background,
            "median_background": statistics.median(background) if background else None,
            "median_step_s": statistics.median(steps) if steps else None,
            "bytes": statistics.median(r["bytes"] for r in mine),
        }
    sync = modes.get("sync", {}).get("median_stall")
    for found in modes.values():
        if sync and "median_stall" in found:
            found["over_sync"] = found["median_stall"] / sync
    return {"runs": runs, "modes": modes}


# ------------------------------------------------------------------ report
def machine() -> dict:
    """Cores, CPU model, load average and the versions the numbers depend on."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("s3fs", "moto", "torch"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return {
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu": model,
        "load": os.getloadavg()[0],
        "versions": versions,
    }


def megabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def report(result: dict, args) -> str:
    """The results as markdown."""
    m = result["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [
        f"{result['date']}, {m['cores']} cores ({m['cpu']}), load average {m['load']:.1f} at the start and "
        f"{result['load_after']:.1f} at the end; {versions}:",
        "",
        "```bash",
        result["command"],
        "```",
    ]
    if up := result.get("upload"):
        lines += [
            "",
            f"Upload of one rank's checkpoint files ({args.preset if not args.checkpoint else up['checkpoint']}, "
            f"{up['files']} files, {megabytes(up['bytes'])}), {args.rounds} round(s):",
            "",
            "| way | MB/s, median | rounds |",
            "|---|---:|---|",
            *(
                f"| {WAY_NAMES[way]} | {up['median_mb_per_s'][way]:.1f} | "
                f"{', '.join(f'{r:.0f}' for r in up['mb_per_s'][way])} |"
                for way in WAYS
            ),
            "",
            f"`RemoteStore` / s3fs: **{up['ratio']:.2f}** (rounds {min(up['ratios']):.2f}–"
            f"{max(up['ratios']):.2f}; target ≥ 0.8).",
        ]
    if stall := result.get("stall"):
        modes = stall["modes"]
        done = [f for f in modes.values() if "median_stall" in f]
        steps = [f["median_step_s"] for f in done if f["median_step_s"] is not None]
        size = (
            f", {megabytes(statistics.median(f['bytes'] for f in done))} per save" if done else ""
        )
        step = f", a step {statistics.median(steps):.2f} s (median)" if steps else ""
        lines += [
            "",
            f"Training stall per save ({args.preset}, {args.nproc} rank(s), seq {args.seq_len} × {args.micro}, "
            f"{args.saves} saves, one every {args.interval} steps{step}{size}), {args.stall_rounds} run(s) per mode:",
            "",
            "| mode | stall per save, median | stalls | background, median | ÷ sync |",
            "|---|---:|---|---:|---:|",
        ]
        notes = []
        for mode, found in modes.items():
            name = MODES[mode][1]
            if "error" in found:
                lines.append(f"| {name} | failed | | | |")
                notes.append(f"{mode}: {found['error']}")
                continue
            background = found["median_background"]
            over = f"{found['over_sync']:.2f}" if "over_sync" in found else ""
            lines.append(
                f"| {name} | {found['median_stall']:.2f} s | "
                f"{', '.join(f'{s:.1f}' for s in found['stalls'])} s | "
                f"{'–' if background is None else f'{background:.1f} s'} | {over} |"
            )
            between = found["median_step_s"] and found["median_step_s"] * args.interval
            if background and between and background > between:
                notes.append(
                    f"{mode}: a save's background time ({background:.1f} s) outlasted the {args.interval} steps "
                    f"to the next save (about {between:.1f} s), whose stall counts the wait; --interval "
                    f"{math.ceil(1.5 * background / found['median_step_s'])} measures the stall alone"
                )
        if "over_sync" in modes.get("async-bucket", {}):
            lines += [
                "",
                f"async into the bucket ÷ sync: **{modes['async-bucket']['over_sync']:.2f}** (target ≤ 1.2).",
            ]
        lines += [f"\nNote: {n}" for n in notes]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="upload,stall", help="upload, stall or both")
    parser.add_argument("--preset", default="100m-h4b16k")
    parser.add_argument("--rounds", type=int, default=5, help="upload rounds (each: both ways)")
    parser.add_argument(
        "--checkpoint", type=Path, help="upload this step directory instead of a fresh one"
    )
    parser.add_argument(
        "--modes", default="sync,async-bucket", help=f"stall modes, of {', '.join(MODES)}"
    )
    parser.add_argument("--saves", type=int, default=3, help="saves per run (the last at its end)")
    parser.add_argument("--interval", type=int, default=5, help="steps between saves")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument(
        "--micro", type=int, default=1, help="sequences per step and rank (one micro-batch)"
    )
    parser.add_argument("--nproc", type=int, default=1, help="ranks of the stall runs")
    parser.add_argument("--stall-rounds", type=int, default=1, help="runs per mode, in turn")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(parts) - {"upload", "stall"} or set(args.modes) - set(MODES):
        parser.error(f"unknown parts or modes: {', '.join(sorted(unknown))}")
    for package in ("moto", "s3fs"):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"needs {package}: pip install -e '.[dev,s3]'") from None

    result = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "tools/bench_checkpoint_upload.py", *sys.argv[1:]]),
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory() as tmp, s3_server() as env:
        if "upload" in parts:
            path = args.checkpoint or make_checkpoint(Path(tmp) / "checkpoint", args)
            result["upload"] = measure_upload(path.resolve(), args)
        if "stall" in parts:
            result["stall"] = measure_stall(Path(tmp), args, env)
    result["load_after"] = os.getloadavg()[0]
    print(report(result, args))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if any("error" in f for f in result.get("stall", {}).get("modes", {}).values()):
        sys.exit(1)


if __name__ == "__main__":
    main()

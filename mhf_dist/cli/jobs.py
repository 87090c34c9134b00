"""``submit``, ``submit-data`` and ``status``: jobs on a cluster and a run's progress."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mhf_dist.cli.options import (
    add_cluster_options,
    add_overwrite,
    add_preparation_options,
    add_run_options,
    load_run_config,
    node_range,
    positive_int,
    preparation_options,
)


def cmd_submit(args) -> int:
    from mhf_dist.cluster.elastic import check_range
    from mhf_dist.cluster.submit import render, submit, write_script
    from mhf_dist.storage.run_dir import RunDir

    cfg, profile, run_dir = _run_config(args), _chosen_profile(args), Path(args.run_dir)
    chosen = _chosen_scheduler(args, profile)
    min_nodes, nodes = args.nodes
    if min_nodes is None and profile.min_nodes is not None and profile.min_nodes < nodes:
        min_nodes = profile.min_nodes  # the site's elastic default
    script = render(
        chosen,
        cfg,
        profile,
        nodes=nodes,
        run_dir=run_dir,
        preset=args.preset,
        config=args.config,
        overrides=args.overrides,
        grace=args.grace,
        depends_on=args.depends_on,
        hostfile=args.hostfile,
        python=args.python,
        min_nodes=min_nodes,
    )
    if (
        min_nodes is not None
    ):  # which node counts train the batch, before the job runs on some of them
        print(check_range(cfg, min_nodes, nodes, profile.gpus_per_node), file=sys.stderr)
    if args.dry_run:
        print(script, end="")
        if note := chosen.manual_note(RunDir(run_dir.resolve()).jobs_dir):
            print(note, file=sys.stderr)
        return 0
    if args.write:
        path = write_script(script, Path(args.write), run_dir)
        print(f"wrote {path}; {chosen.how_to_submit(path)}")
        return 0
    if (
        args.hostfile
    ):  # the hostfile scheduler's job (_chosen_scheduler): started here, not submitted
        path = write_script(script, run_dir.resolve() / chosen.script_name, run_dir)
        print(f"starting {path}")
        return subprocess.call(["bash", str(path)])
    job = submit(chosen, script, run_dir, profile.name, nodes)
    print(
        f"submitted job {job}; logs: {RunDir(run_dir.resolve()).jobs_dir}/mhf-{run_dir.resolve().name}-{job}.out; "
        f"progress: mhf-dist status {run_dir}"
    )
    return 0


def _chosen_scheduler(args, profile):
    """``--scheduler``; else, with ``--hostfile``, the hostfile scheduler; else the profile's."""
    from mhf_dist.cluster.scheduler import scheduler
    from mhf_dist.errors import ConfigError

    name = args.scheduler or ("hostfile" if args.hostfile else profile.scheduler)
    if args.hostfile and name != "hostfile":
        raise ConfigError(
            f"--hostfile names the nodes of a hostfile job, which --scheduler {name} does not start: "
            f"leave out --hostfile, or --scheduler {name}"
        )
    return scheduler(name)


def _run_config(args):
    """The preset and/or config file with ``--set``; without either, the run directory's own config.yaml, as
    ``train --run-dir`` (which the job runs) takes it."""
    if args.preset or args.config:
        return load_run_config(args)
    from mhf_dist.train.resume import resume_config

    return resume_config(args.run_dir, args.overrides, "auto")


def _chosen_profile(args):
    """The cluster profile with the partition, account, time, qos and the schedulers' options given on the command
    line."""
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.cluster.scheduler import schedulers

    profile = load_profile(args.cluster)
    chosen = {
        k: getattr(args, k)
        for k in ("partition", "account", "time", "qos")
        if getattr(args, k) is not None
    }
    profile = profile.model_copy(update=chosen)
    for s in schedulers().values():
        profile = s.with_arguments(profile, args)
    return profile


def submit_parser(sub) -> None:
    from mhf_dist.cluster.scheduler import schedulers

    p = sub.add_parser(
        "submit",
        help="submit a multi-node training job to a scheduler (SLURM, DeepSpeed's launcher "
        "over a hostfile, or another registered one)",
    )
    add_run_options(p)
    p.add_argument(
        "--run-dir",
        required=True,
        help="run directory on storage every node sees; without --preset and "
        "--config, the job resumes with its config.yaml",
    )
    p.add_argument(
        "--nodes",
        type=node_range,
        default=(None, 1),
        metavar="N|MIN-MAX",
        help="nodes of the cluster profile's kind; MIN-MAX: an elastic job, which continues on the nodes "
        "left (at least MIN) when one is lost, as many as train the global batch with every rank busy "
        "(MIN and a count below MAX must; default MIN: the profile's min_nodes)",
    )
    add_cluster_options(p)
    p.add_argument(
        "--grace",
        type=positive_int,
        help="seconds between the scheduler's warning signal (SLURM's USR1) "
        "and the time limit (default: what plan estimates a step and a save need, at least 120)",
    )
    p.add_argument("--depends-on", help="start after this job id ends (afterany)")
    p.add_argument(
        "--scheduler",
        choices=list(schedulers()),
        help="the scheduler the job goes to (default: the profile's scheduler, slurm unless the profile "
        "names another; hostfile with --hostfile)",
    )
    p.add_argument(
        "--hostfile",
        help="the hostfile scheduler (no SLURM): start the ranks with DeepSpeed's launcher "
        "on this hostfile's nodes",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print the job script only")
    what.add_argument(
        "--write",
        metavar="FILE",
        help="write the job script and make its log directory; submit nothing",
    )
    p.set_defaults(func=cmd_submit)


def cmd_elastic_plan(args) -> int:
    from mhf_dist.cluster.elastic import TooFewNodes, plan_round
    from mhf_dist.cluster.requeue import requeue_without
    from mhf_dist.storage.run_dir import RunDir

    cfg = _run_config(args)
    run = RunDir(Path(args.run_dir).resolve())
    try:
        chosen = plan_round(
            cfg,
            run,
            up=_names(args.nodes),
            lost=_names(args.lost),
            tasks_per_node=args.tasks_per_node,
            min_nodes=args.min_nodes,
            ranks_lost=args.ranks_lost,
        )
    except TooFewNodes as e:
        for line in e.story:
            print(f"elastic: {line}", file=sys.stderr)
        if not args.job:
            raise  # said once, as every error is
        print(f"elastic: {e}", file=sys.stderr)
        print(
            f"elastic: {requeue_without(run, args.job, Path(args.script), e.lost)}", file=sys.stderr
        )
        return 2
    for line in chosen.story:
        print(f"elastic: {line}", file=sys.stderr)
    print(chosen.shell())
    return 0


def _names(text: str) -> list[str]:
    """Node names, space- or comma-separated."""
    return [n for n in text.replace(",", " ").split() if n]


def elastic_plan_parser(sub) -> None:
    p = sub.add_parser(
        "elastic-plan",  # unlisted: an elastic job's script calls it
        description="Print the next round of an elastic job (submit --nodes MIN-MAX) as shell values "
        "(NODELIST, NNODES, NTASKS, lost) on the answering nodes, and on stderr what was lost, kept "
        "and chosen; exit 2 when fewer than --min-nodes are left (with --job, after queueing the job "
        "again without the lost nodes).",
    )
    add_run_options(p)
    p.add_argument("--run-dir", required=True, help="the job's run directory")
    p.add_argument(
        "--nodes", required=True, help="the nodes that answered, space- or comma-separated"
    )
    p.add_argument("--lost", default="", help="the nodes that did not")
    p.add_argument(
        "--ranks-lost",
        action="store_true",
        help="the last round's ranks stopped answering (exit 88) while every node answers: leave out the "
        "nodes their record (RUN/heartbeats/lost.json) names",
    )
    p.add_argument("--tasks-per-node", type=positive_int, required=True, help="ranks per node")
    p.add_argument("--min-nodes", type=positive_int, required=True, help="the job's minimum")
    p.add_argument(
        "--job",
        help="this job's id: when too few nodes are left, queue it again without the lost ones",
    )
    p.add_argument("--script", help="this job's script (with --job)")
    p.set_defaults(func=cmd_elastic_plan)


def cmd_requeue(args) -> int:
    from mhf_dist.cluster.requeue import requeue_without
    from mhf_dist.storage.heartbeats import read_lost
    from mhf_dist.storage.run_dir import RunDir

    run = RunDir(Path(args.run_dir).resolve())
    lost = _names(args.lost) if args.lost is not None else read_lost(run).get("nodes", [])
    if not lost:
        print(
            "requeue: no lost node is named (RUN/heartbeats/lost.json): nothing was queued; submit the job again "
            "to resume from the newest checkpoint",
            file=sys.stderr,
        )
        return 2
    print(f"requeue: {requeue_without(run, args.job, Path(args.script), lost)}", file=sys.stderr)
    return 0


def requeue_parser(sub) -> None:
    p = sub.add_parser(
        "requeue",  # unlisted: a job script calls it when a node was lost
        description="Submit a job's script again, to start when the job ends, excluding the nodes it "
        "lost (RUN/heartbeats/lost.json, or --lost) and those excluded before.",
    )
    p.add_argument("--run-dir", required=True, help="the job's run directory")
    p.add_argument("--job", required=True, help="the job's id")
    p.add_argument("--script", required=True, help="the job's script")
    p.add_argument(
        "--lost",
        help="the nodes to exclude, space- or comma-separated (default: those the ranks recorded)",
    )
    p.set_defaults(func=cmd_requeue)


def cmd_submit_data(args) -> int:
    from mhf_dist.cluster import submit as jobs
    from mhf_dist.cluster.scheduler.slurm import DATA_SCRIPTS as names
    from mhf_dist.cluster.scheduler.slurm import SLURM
    from mhf_dist.data.inputs import expand_inputs
    from mhf_dist.data.parts import part_files
    from mhf_dist.remote import is_url

    profile, out = _chosen_profile(args), args.out if is_url(args.out) else Path(args.out)
    jobs_dir = jobs.data_jobs_dir(out, Path(args.jobs_dir) if args.jobs_dir else None)
    # the inputs are there, at least one file per part
    part_files(expand_inputs(args.inputs), 1, args.parts)
    options = [
        "--seq-len",
        str(args.seq_len),
        *preparation_options(args),
        *(["--overwrite"] * args.overwrite),
    ]
    scripts = jobs.render_data(
        profile,
        args.inputs,
        tokenizer=args.tokenizer,
        out=out,
        parts=args.parts,
        options=options,
        workers=args.workers,
        python=args.python,
        jobs_dir=jobs_dir,
    )
    if args.dry_run:
        for name, script in zip(names, scripts):
            print(f"# ---------------- {name}\n{script}", end="")
        print(
            f"# nothing submitted. To submit these scripts yourself, save them as {names[0]} and {names[1]}, run "
            f"`mkdir -p {jobs_dir}` (SLURM does not create the log directory), then "
            f"`{SLURM.data_submission_command(*map(Path, names))}` (or use --write DIR)",
            file=sys.stderr,
        )
        return 0
    if args.write:
        paths = jobs.write_data_scripts(scripts, Path(args.write), out, jobs_dir)
        print(
            f"wrote {paths[0]} and {paths[1]}; submit them with: {SLURM.data_submission_command(*paths)}"
        )
        return 0
    array, merge = jobs.submit_data(*scripts, out, jobs_dir)
    where = out if is_url(out) else out.resolve()
    print(
        f"submitted array job {array} ({args.parts} parts) and merge job {merge} (after all parts succeed); "
        f"logs: {jobs_dir}; the data: {where}"
    )
    return 0


def submit_data_parser(sub) -> None:
    p = sub.add_parser(
        "submit-data",
        help="prepare-data spread over a SLURM cluster: an array job of --parts "
        "tasks, then a job merging them",
        description="Submit an array job whose task I runs "
        "`prepare-data --part I/N` on one node, and a job that merges the parts (`prepare-data "
        "--merge`) once every task succeeded (afterok). Scripts and logs go into OUT/jobs; the "
        "merged OUT trains as a one-process preparation of the same inputs would.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="input files or globs, as prepare-data takes them (on storage every node "
        "sees; relative ones are made absolute)",
    )
    p.add_argument("--tokenizer", required=True, help="tokenizer directory, or mistral-v0.3")
    p.add_argument(
        "--out",
        required=True,
        help="the dataset directory: part I goes into OUT/part-I-of-N, the merge "
        "writes OUT/manifest.json; or its URL in object storage (s3://bucket/data: give --jobs-dir)",
    )
    p.add_argument(
        "--jobs-dir",
        metavar="DIR",
        help="where the job scripts and their logs go, on storage every node sees (default OUT/jobs; needed "
        "with an --out in object storage)",
    )
    p.add_argument(
        "--seq-len",
        type=positive_int,
        required=True,
        help="model sequence length; samples hold seq_len + 1 ids",
    )
    p.add_argument(
        "--parts",
        type=positive_int,
        required=True,
        help="array tasks, each preparing a contiguous run of the input files (at most one per file)",
    )
    add_preparation_options(p)
    p.add_argument(
        "--workers",
        type=positive_int,
        help="tokenizer processes (and cores) per task (default: the profile's cores_per_node)",
    )
    add_overwrite(p)
    add_cluster_options(p)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print the two job scripts only")
    what.add_argument(
        "--write",
        metavar="DIR",
        help="write the two job scripts into DIR and make the log directory; submit nothing",
    )
    p.set_defaults(func=cmd_submit_data)


def cmd_status(args) -> int:
    from mhf_dist.cluster.status import command_target, show

    run_dir, watch = command_target(args.run_dir, args.watch)
    return show(run_dir, args.json, watch, args.stale_minutes, args.verify)


def status_parser(sub) -> None:
    from mhf_dist.cluster.status import DEFAULT_WATCH_S, STALE_HELP, positive_number

    p = sub.add_parser(
        "status",
        help="a run's progress: step, loss, throughput, ETA, checkpoint, job; flags a stalled run",
        description="Read a run directory (no process needs to run there): "
        "step, tokens, loss, tokens/s, MFU, time since the last logged step (STALE past a threshold), "
        "ETA, newest complete checkpoint whose files check out (and those that do not), validation, "
        "divergence counters, the run lock's holder (gone or not), and the job of a submitted "
        "run (when its scheduler can be asked). Exits 2 if RUN_DIR is not a run directory.",
    )
    p.add_argument(
        "run_dir",
        nargs="?",
        metavar="RUN_DIR",
        help="the --run-dir of `mhf-dist train` or `submit`",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (keys: RunStatus's fields, mhf_dist/cluster/run_status.py; one line "
        "per refresh with --watch)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        const=str(DEFAULT_WATCH_S),
        metavar="SECONDS",
        help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C",
    )
    p.add_argument("--stale-minutes", type=positive_number, metavar="MINUTES", help=STALE_HELP)
    p.add_argument(
        "--verify",
        action="store_true",
        help="check the checkpoints' SHA-256 digests too, not only their "
        "files' sizes (reads every file of the newest ones, as a resume does)",
    )
    p.set_defaults(func=cmd_status)

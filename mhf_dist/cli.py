"""``mhf-dist`` command line: parse, validate the config, call one function."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from mhf_dist import __version__
from mhf_dist.backend import RANK_MODULES, accelerator_env
from mhf_dist.config import SIZES, ConfigError, RunConfig, load_config, preset_names
from mhf_dist.errors import ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE, RANK_LOST_EXIT_CODE, MhfError
from mhf_dist.storage.output_dir import OVERWRITE_HELP

RANK_PRELOAD = ("mhf_dist.train.loop", *RANK_MODULES)  # what a training rank imports (a forked one, once for all)

DESCRIPTION = """\
Distributed training for MultiHashFormer language models: each token is a
signature of H hash coordinates into H bucket tables instead of an embedding
row. Tensor, pipeline and ZeRO data parallelism on DeepSpeed; sharded
checkpoints that resume after preemption; SLURM jobs; export to Hugging Face."""

EXAMPLES = """\
examples:
  mhf-dist train --preset tiny-h4b16k --nproc-per-node 2 --run-dir runs/tiny
  mhf-dist status runs/tiny
  mhf-dist plan --preset 3b-h4b16k --cluster a100-80g --nodes 4
  mhf-dist submit --preset 1b-h4b16k --set data.path=/shared/shards --cluster a100-80g --nodes 2 \\
      --partition gpu --time 24:00:00 --run-dir /shared/runs/1b
  mhf-dist export-hf runs/tiny runs/tiny-hf && mhf-dist generate --model runs/tiny-hf --prompt "In the beginning"

`mhf-dist COMMAND --help` describes a command's options."""


def positive_int(text: str) -> int:
    """An argparse type: a whole number ≥ 1 (a count of ranks, nodes, steps, seconds, ...)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def part_of(text: str) -> tuple[int, int]:
    """An argparse type: ``I/N``, two whole numbers (part I of N; the range is checked against the inputs)."""
    index, slash, count = text.partition("/")
    if not slash or not index.isdigit() or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected I/N (part I of N, e.g. 3/8), got {text!r}")
    return int(index), int(count)


def _add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="floating-point type of the weights")


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint; before the "
                   "first, its initial weights: train.init_from)")


def _add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="{size}-{variant}, e.g. tiny-h4b16k, 100m-standard+4l, 3b-h4b16k")
    p.add_argument("--config", help="run YAML (may name a `preset:` to start from)")
    _add_overrides(p, "override any config field, e.g. --set model.hash.num_buckets=4096 (repeatable)")


def _load(args) -> RunConfig:
    return load_config(args.preset, args.config, args.overrides)


def cmd_train(args) -> int:
    if Path(args.run_dir).exists() and not Path(args.run_dir).is_dir():
        raise ConfigError(f"--run-dir {args.run_dir} is a file; name a directory (it is created if missing)")
    cfg = _load_train(args)  # validate before starting any rank
    from mhf_dist.cluster.launch import launch_local, slurm_rank_env, supervise_slurm_task
    from mhf_dist.train.preemption import StopSignal, lost_work

    def lost() -> str:
        return lost_work(args.run_dir, cfg.train.checkpoint_minutes)

    if "RANK" not in os.environ and args.nproc_per_node:
        from mhf_dist.parallel.devices import device_type
        from mhf_dist.parallel.layout import preflight

        device = device_type(cfg)
        preflight(cfg, args.nproc_per_node, device)
        # before this process loads the backend for the ranks it forks, and in the environment of those it starts:
        # they compute on train.device even where a GPU is visible (each rank also sets it, for other launchers)
        os.environ.update(accelerator_env(device))
        preload = RANK_PRELOAD if device == "cpu" else ()  # CPU ranks are forked
        return launch_local(args.nproc_per_node, _without_option(sys.argv[1:], "--nproc-per-node"), lost, preload)
    if "RANK" not in os.environ and slurm_rank_env():  # an srun task: its rank runs watched, so its death is named
        return supervise_slurm_task(sys.argv[1:], lost)

    stop = StopSignal(lost)  # before the training stack loads: from now on a signal is noted, not fatal
    # each line out as it is written, also into a job log or a pipe (which Python would otherwise fill in blocks)
    sys.stdout.reconfigure(line_buffering=True)
    from mhf_dist.train.loop import collective_failure, leave_process_group, train

    try:
        result = train(cfg, args.run_dir, args.resume, stop, args.verbose)
    except Exception as e:
        if (failure := collective_failure(e)) is None:
            raise
        stop.ignore()  # nothing is left to save, and the job's end (srun stopping its tasks) must not cut this exit
        if args.debug:
            raise
        print(f"mhf-dist{_rank_label()}: {failure}; stopping (--debug shows the traceback)", file=sys.stderr)
        return RANK_LOST_EXIT_CODE
    finally:  # also after an error: a process group left to interpreter shutdown can abort the process
        leave_process_group()
    if result.records:  # rank 0
        print(_outcome(result, stop, Path(args.run_dir)))
    return PREEMPTED_EXIT_CODE if result.preempted else 0


def _outcome(result, stop, run_dir: Path) -> str:
    """Rank 0's last line: where a Ctrl-C left the run, or the last step's numbers and where the logs are."""
    if stop.interrupted and result.saved is not None:
        return f"interrupted: saved {result.saved.name}; rerun the same command to resume"
    last = result.records[-1]
    return (f"{'preempted' if result.preempted else 'done'}: step {last['step']}, loss {last['loss']:.4f}, "
            f"{last['tokens_per_s']:.0f} tokens/s, MFU {last['mfu']:.1%}; run directory {run_dir.resolve()} "
            f"(tensorboard --logdir {run_dir.resolve() / 'tensorboard'})")


def _load_train(args) -> RunConfig:
    """The preset and/or config file with ``--set``; without either, the run's own config.yaml, where ``--set``
    may change only what a resume can (:mod:`mhf_dist.train.resume`)."""
    if args.preset or args.config:
        return _load(args)
    from mhf_dist.train.resume import resume_config

    return resume_config(args.run_dir, args.overrides, args.resume)


def _without_option(argv: list[str], option: str) -> list[str]:
    """``argv`` less ``option VALUE`` / ``option=VALUE``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def cmd_plan(args) -> int:
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.commands.plan import format_plan, memory_plan

    cfg, profile = _load(args), load_profile(args.cluster)
    plans = memory_plan(cfg, profile, args.nodes, args.vocab_size)
    print(format_plan(cfg, profile, args.nodes, plans, mfu=args.mfu, vocab_size=args.vocab_size))
    return 0


def cmd_export(args) -> int:
    from mhf_dist.commands.export import export

    print(f"wrote {export(args.checkpoint, args.out, args.dtype, args.overwrite)}")
    return 0


def cmd_export_hf(args) -> int:
    from mhf_dist.hf.exporter import export_hf

    out = export_hf(args.checkpoint, args.out_dir, args.dtype, args.overwrite, args.inference_temperature)
    print(f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return 0


def cmd_import_hf(args) -> int:
    from mhf_dist.hf.importer import import_hf

    report = import_hf(args.dir, args.run_dir, args.overrides, args.overwrite)
    print(report.summary())
    print(f"continue with: mhf-dist train --run-dir {args.run_dir} --config {Path(args.run_dir) / 'config.yaml'}")
    return 0


def cmd_generate(args) -> int:
    from mhf_dist.commands.generate import generate, load_for_inference

    model, tokenizer = load_for_inference(args.model, args.dtype, args.device, args.trust_remote_code)
    stream = not args.json and args.num_beams == 1  # beam search settles its text only at the end
    ids = generate(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, num_beams=args.num_beams, seed=args.seed, compile=args.compile,
                   on_text=(lambda piece: print(piece, end="", flush=True)) if stream else None)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"model": str(args.model), "prompt": args.prompt, "completion": text,
                          "new_tokens": len(ids)}))
    else:
        print("" if stream else args.prompt + text)
    return 0


def cmd_eval(args) -> int:
    from mhf_dist.commands.evaluate import last_word_accuracy, perplexity
    from mhf_dist.commands.generate import load_for_inference

    if not (args.data or args.lambada):
        raise ConfigError("nothing to evaluate: pass --data SHARDS and/or --lambada FILE.jsonl")
    model, tokenizer = load_for_inference(args.model, args.dtype, args.device, args.trust_remote_code)
    results = {"model": str(args.model)}
    if args.data:
        calibrate = args.calibrate or args.calibration_split is not None
        if calibrate and (args.calibration_split or args.split) == args.split:
            print(f"note: τ is fitted on the evaluated split ({args.split}), so its calibrated perplexity is "
                  "optimistic; fit it on another split with --calibration-split", file=sys.stderr)
        results["perplexity"] = perplexity(model, tokenizer, args.data, args.split, args.max_sequences,
                                           args.batch_size, calibrate, args.calibration_split)
    if args.lambada:
        results["last_word"] = last_word_accuracy(model, tokenizer, args.lambada)
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def cmd_expand_vocab(args) -> int:
    from mhf_dist.commands.expand_vocab import expand_vocab

    print(expand_vocab(args.run_dir, args.tokenizer, args.out, args.trainable_blocks, args.overrides,
                       args.overwrite).summary())
    return 0


def cmd_submit(args) -> int:
    from mhf_dist.cluster.submit import manual_submission_note, render, submit, write_script

    cfg, profile, run_dir = _load(args), _chosen_profile(args), Path(args.run_dir)
    kind = "hostfile" if args.hostfile else "sbatch"
    script = render(kind, cfg, profile, args.nodes, run_dir, preset=args.preset, config=args.config,
                    overrides=args.overrides, grace=args.grace, depends_on=args.depends_on, hostfile=args.hostfile,
                    python=args.python)
    if args.dry_run:
        print(script, end="")
        if kind == "sbatch":
            print(manual_submission_note(run_dir), file=sys.stderr)
        return 0
    if args.write:
        path = write_script(script, Path(args.write), run_dir)
        how = f"submit it with: sbatch {path}" if kind == "sbatch" else f"start it with: bash {path}"
        print(f"wrote {path}; {how}")
        return 0
    if kind == "hostfile":
        path = write_script(script, run_dir.resolve() / "launch.sh", run_dir)
        print(f"starting {path}")
        return subprocess.call(["bash", str(path)])
    job = submit(script, run_dir, profile.name, args.nodes)
    print(f"submitted job {job}; logs: {run_dir.resolve() / 'slurm'}/mhf-{run_dir.resolve().name}-{job}.out; "
          f"progress: mhf-dist status {run_dir}")
    return 0


def _chosen_profile(args):
    """The cluster profile with the partition, account, time, qos and sbatch options given on the command line."""
    from mhf_dist.cluster.profile import load_profile

    profile = load_profile(args.cluster)
    chosen = {k: getattr(args, k) for k in ("partition", "account", "time", "qos") if getattr(args, k) is not None}
    return profile.model_copy(update=chosen | {"sbatch_args": [*profile.sbatch_args, *args.sbatch_args]})


def cmd_submit_data(args) -> int:
    from mhf_dist.cluster import submit as jobs
    from mhf_dist.data.prepare import expand_inputs, part_files

    profile, out = _chosen_profile(args), Path(args.out)
    part_files(expand_inputs(args.inputs), 1, args.parts)  # the inputs are there, at least one file per part
    options = ["--seq-len", str(args.seq_len), *_preparation_options(args), *(["--overwrite"] * args.overwrite)]
    scripts = jobs.render_data(profile, args.inputs, args.tokenizer, out, args.parts, options, workers=args.workers,
                               python=args.python)
    names = jobs.DATA_SCRIPTS
    if args.dry_run:
        for name, script in zip(names, scripts):
            print(f"# ---------------- {name}\n{script}", end="")
        print(f"# nothing submitted. To submit these scripts yourself, save them as {names[0]} and {names[1]}, run "
              f"`mkdir -p {out.resolve() / jobs.LOG_DIR}` (SLURM does not create the log directory), then "
              f"`{jobs.data_submission_command(*map(Path, names))}` (or use --write DIR)", file=sys.stderr)
        return 0
    if args.write:
        paths = [jobs.write_script(script, Path(args.write) / name, out) for name, script in zip(names, scripts)]
        print(f"wrote {paths[0]} and {paths[1]}; submit them with: {jobs.data_submission_command(*paths)}")
        return 0
    array, merge = jobs.submit_data(*scripts, out)
    print(f"submitted array job {array} ({args.parts} parts) and merge job {merge} (after all parts succeed); "
          f"logs: {out.resolve() / jobs.LOG_DIR}; the data: {out.resolve()}")
    return 0


def cmd_status(args) -> int:
    from mhf_dist.cluster.status import command_target, show

    run_dir, watch = command_target(args.run_dir, args.watch)
    return show(run_dir, args.json, watch, args.stale_minutes, args.verify)


def cmd_profile(args) -> int:
    from mhf_dist.cluster.profile import load_profile
    from mhf_dist.profiling.report import table, write_outputs
    from mhf_dist.profiling.scoring import profile_scoring
    from mhf_dist.profiling.sweep import run_sweep
    from mhf_dist.profiling.timing import hardware_name

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nominal = load_profile(args.cluster).peak_bf16_tflops if args.cluster else None
    tps = [int(layout.removeprefix("tp=")) for layout in args.layout.split(",")]
    rows = run_sweep(args.size, args.hash.split(","), tps, steps=args.steps, warmup=args.warmup, seq_len=args.seq_len,
                     micro=args.micro_batch, dtype=args.dtype, out=out, peak_nominal=nominal,
                     overrides=args.overrides, trace=args.trace)
    cfg = load_config(f"{args.size}-h4b16k").model
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scoring = profile_scoring([int(v) for v in args.vocab_sizes.split(",")], cfg, device, args.dtype)
    no_plots = write_outputs(rows, scoring, out, hardware_name(device))
    print(table(rows, scoring))
    pngs = "" if no_plots else "throughput.png, memory.png, scoring.png, "
    note = f"; {no_plots}" if no_plots else ""
    print(f"wrote {out}/profile.csv, profile.json, scoring.csv, {pngs}tensorboard/{note}")
    return 0


def cmd_profile_worker(args) -> int:
    from mhf_dist.profiling.sweep import worker_main

    return worker_main(args.rows, args.spec)


def cmd_config(args) -> int:
    import yaml

    cfg = _load(args)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    if cfg.train.wandb is None:  # off; its fields would otherwise stay hidden behind `wandb: null`
        from mhf_dist.config import WandbConfig

        print("# train.wandb is off (null); --set train.wandb.project=NAME turns it on, with these fields:")
        for name, field in WandbConfig.model_fields.items():
            print(f"#   train.wandb.{name}: {field.default}  ({field.description})")
    return 0


def cmd_presets(args) -> int:
    print("\n".join(preset_names()))
    return 0


def cmd_tokenizer_train(args) -> int:
    from mhf_dist.vocab.tokenizers import read_text_files, train_bpe

    out = train_bpe(read_text_files(args.input), args.vocab_size, args.out)
    print(f"wrote a {args.vocab_size}-token byte-level BPE to {out}")
    return 0


def cmd_tokenizer_mistral(args) -> int:
    from mhf_dist.vocab.tokenizers import load_tokenizer, write_mistral_v03

    out = write_mistral_v03(args.out)
    print(f"wrote Mistral v0.3 ({len(load_tokenizer(out))} pieces) to {out}")
    return 0


def cmd_prepare_data(args) -> int:
    from mhf_dist.commands.prepare_data import run

    return run(args)


# ---------------------------------------------------------------- the parser: one function per command
def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model (run under torchrun for many ranks, or use --nproc-per-node)")
    _add_run_options(p)
    p.add_argument("--run-dir", required=True, help="run directory (created if missing); without --preset and "
                   "--config, the run resumes with its own config.yaml (--set may change what a resume can)")
    p.add_argument("--nproc-per-node", type=positive_int, help="start this many local ranks on this machine")
    p.add_argument("--resume", default="auto", help="auto (newest complete checkpoint, if any), none, or a "
                   f"checkpoint directory; a run stopped by a signal exits with {PREEMPTED_EXIT_CODE}")
    p.add_argument("--verbose", action="store_true", help="also show DeepSpeed's start-up lines (op builds, "
                   "pipeline topology), which are held back otherwise")
    p.set_defaults(func=cmd_train)


def _prepare_data_parser(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize text into WebDataset shards of packed sequences + manifest",
                       usage="%(prog)s INPUTS... --tokenizer DIR --out DIR --seq-len L [--part I/N] [options]\n"
                       "       %(prog)s --merge OUT PART_DIRS... [--overwrite]")
    p.add_argument("inputs", nargs="+", help="text files, directories (their files, sorted) or globs: .txt "
                   "(blank-line separated documents) or .jsonl (one document per line), optionally .gz or .zst, and "
                   ".parquet (one document per row); .zst and .parquet need pip install 'mhf-dist[data]'. With "
                   "--merge: the part directories")
    p.add_argument("--tokenizer", help="tokenizer directory, or mistral-v0.3 (required unless --merge)")
    p.add_argument("--out", help="output directory (new or empty; see --overwrite; required unless --merge)")
    _add_overwrite(p)
    p.add_argument("--seq-len", type=positive_int,
                   help="model sequence length; samples hold seq_len + 1 ids (required unless --merge)")
    p.add_argument("--part", type=part_of, metavar="I/N",
                   help="prepare only part I (1..N) of N contiguous runs of the input files, into OUT/part-I-of-N "
                   "(a SLURM array task: --part $SLURM_ARRAY_TASK_ID/N); merge the parts with --merge")
    p.add_argument("--merge", metavar="OUT", help="write one manifest over the parts (directories inside OUT, given "
                   "as the inputs) into OUT, shards left in place; it trains as a one-process preparation would")
    _add_preparation_options(p)
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all cores)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_prepare_data)


_PREPARATION_OPTIONS = ("samples_per_shard", "prefix", "text_field", "on_bad_document", "val_fraction")


def _add_preparation_options(p: argparse.ArgumentParser) -> None:
    """How documents become shards (``_PREPARATION_OPTIONS``): shared by prepare-data and submit-data."""
    p.add_argument("--samples-per-shard", type=positive_int, default=8192, help="samples per tar shard (default 8192)")
    p.add_argument("--prefix", default="train", help="training shard names: PREFIX-000000.tar ... (default train)")
    p.add_argument("--text-field", default="text", help="the field (.jsonl) or column (.parquet) holding the text")
    p.add_argument("--on-bad-document", choices=("error", "skip"), default="error",
                   help="a document that is not a string: stop, naming its file and line or row (error), or leave it "
                   "out and count it in the manifest (skip)")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="fraction of documents held out (by a hash of their text) into val-*.tar shards")


def _preparation_options(args) -> list[str]:
    """The ``_PREPARATION_OPTIONS`` of ``args`` as prepare-data arguments."""
    return [a for name in _PREPARATION_OPTIONS for a in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def _submit_data_parser(sub) -> None:
    p = sub.add_parser("submit-data", help="prepare-data spread over a SLURM cluster: an array job of --parts "
                       "tasks, then a job merging them", description="Submit an array job whose task I runs "
                       "`prepare-data --part I/N` on one node, and a job that merges the parts (`prepare-data "
                       "--merge`) once every task succeeded (afterok). Scripts and logs go into OUT/slurm; the "
                       "merged OUT trains as a one-process preparation of the same inputs would.")
    p.add_argument("inputs", nargs="+", help="input files or globs, as prepare-data takes them (on storage every node "
                   "sees; relative ones are made absolute)")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory, or mistral-v0.3")
    p.add_argument("--out", required=True, help="the dataset directory: part I goes into OUT/part-I-of-N, the merge "
                   "writes OUT/manifest.json")
    p.add_argument("--seq-len", type=positive_int, required=True,
                   help="model sequence length; samples hold seq_len + 1 ids")
    p.add_argument("--parts", type=positive_int, required=True,
                   help="array tasks, each preparing a contiguous run of the input files (at most one per file)")
    _add_preparation_options(p)
    p.add_argument("--workers", type=positive_int, help="tokenizer processes (and cores) per task (default: the "
                   "profile's cores_per_node)")
    _add_overwrite(p)
    _add_cluster_options(p)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print the two job scripts only")
    what.add_argument("--write", metavar="DIR", help="write the two job scripts into DIR and make the log directory; "
                      "submit nothing")
    p.set_defaults(func=cmd_submit_data)


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="the resolved model; ZeRO model states, activations and "
                       "host memory at construction per rank; does it fit? time per step at an assumed MFU")
    _add_run_options(p)
    p.add_argument("--cluster", required=True, help="cluster profile: a100-80g, mi300x, cpu-local or a .yaml path")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes of the cluster profile's kind")
    p.add_argument("--vocab-size", type=positive_int, default=32768, help="registered tokens (default: Mistral v0.3's)")
    p.add_argument("--mfu", type=float, default=0.40,
                   help="assumed model FLOPs utilisation for the time per step, a fraction in (0, 1] (default 0.40)")
    p.set_defaults(func=cmd_plan)


def _export_parser(sub) -> None:
    p = sub.add_parser("export", help="one full state dict (safetensors) + config + signatures + tokenizer "
                       "from a sharded checkpoint")
    _add_checkpoint(p)
    p.add_argument("--out", required=True)
    _add_dtype(p)
    _add_overwrite(p)
    p.set_defaults(func=cmd_export)


def _export_hf_parser(sub) -> None:
    p = sub.add_parser("export-hf", help="a Hugging Face model directory (the authors' layout) from a "
                       "checkpoint; logits are log P_inf")
    _add_checkpoint(p)
    p.add_argument("out_dir")
    _add_dtype(p)
    _add_overwrite(p)
    p.add_argument("--inference-temperature", metavar="TAU|auto",
                   help="τ of the exported logits log_softmax(τ · log P_inf) (config.json's inference_temperature); "
                   "auto: the val_temperature training fitted last (at or before the checkpoint's step), else one "
                   "fitted on the run's validation split; default: the run config's inference.temperature (1). "
                   "A Standard model exports only with 1")
    p.set_defaults(func=cmd_export_hf)


def _import_hf_parser(sub) -> None:
    p = sub.add_parser("import-hf", help="a run directory to continue training from a model in the authors' "
                       "layout (their releases or export-hf); lists signature differences")
    p.add_argument("dir", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--run-dir", required=True, help="new run directory")
    _add_overrides(p, "override the imported run config, e.g. --set data.path=SHARDS (repeatable)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_import_hf)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="export-hf directory, or a run / checkpoint directory")
    _add_dtype(p)
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:1, ...")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model directory's Python files even when they are not this package's own")


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text under P_inf (greedy, temperature, top-k, top-p, beams)")
    _add_model_options(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=50,
                   help="tokens to generate after the prompt (at most what the model's positions leave)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--num-beams", type=positive_int, default=1, help="beam search width (1: greedy or sampling)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed of sampling")
    p.add_argument("--compile", action="store_true",
                   help="static KV cache and a compiled decode step (CUDA graphs on GPUs); compiling takes a while")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end (model, prompt, completion, "
                   "new_tokens) instead of the text as it is generated")
    p.set_defaults(func=cmd_generate)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity on shards and LAMBADA-style last-word accuracy, under P_inf")
    _add_model_options(p)
    p.add_argument("--data", help="shard directory (made with the model's tokenizer)")
    p.add_argument("--split", default="val", help="split of the shards to evaluate (val or train)")
    p.add_argument("--max-sequences", type=positive_int,
                   help="evaluate (and calibrate on) at most this many sequences of the split")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the temperature τ of P_τ ∝ P_inf^τ on --calibration-split and report the calibrated "
                   "perplexity at it (without: at the model's own inference_temperature)")
    p.add_argument("--calibration-split", metavar="SPLIT",
                   help="the split τ is fitted on (implies --calibrate; default: --split itself, which is optimistic)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")
    p.add_argument("--lambada", help='JSONL of {"text": ...}; the target is the last word')
    p.add_argument("--out", help="also write the results (JSON) here")
    p.set_defaults(func=cmd_eval)


def _expand_vocab_parser(sub) -> None:
    p = sub.add_parser("expand-vocab", help="register a superset tokenizer's new tokens (MHF: 0 new parameters) "
                       "into a new run directory that continues training")
    p.add_argument("--run-dir", required=True, help="the trained run (its newest checkpoint is used)")
    p.add_argument("--tokenizer", required=True, help="the new tokenizer directory (old ids kept, tokens appended)")
    p.add_argument("--out", help="new run directory (default: RUN_DIR-vocab<V>)")
    p.add_argument("--trainable-blocks", type=non_negative_int,
                   help="train only the vocabulary side, the final norm and the first and last k blocks (the paper's "
                   "expansion stage); default: everything")
    _add_overrides(p, "override the new run's config, e.g. --set train.max_steps=1000 (repeatable)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_expand_vocab)


def _add_cluster_options(p: argparse.ArgumentParser) -> None:
    """The cluster profile and what a submission may change of it (submit, submit-data)."""
    p.add_argument("--cluster", required=True, help="cluster profile: a100-80g, mi300x, cpu-local or a .yaml path")
    p.add_argument("--partition", help="SLURM partition (instead of the profile's)")
    p.add_argument("--account", help="SLURM account to charge (instead of the profile's)")
    p.add_argument("--time", help="time limit, e.g. 24:00:00 or 2-00:00:00 (instead of the profile's)")
    p.add_argument("--qos", help="SLURM quality of service (instead of the profile's)")
    p.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="OPTION",
                   help="one more #SBATCH option, e.g. --sbatch-arg=--constraint=a100 (repeatable)")
    p.add_argument("--python", help="the Python on the nodes (default: the profile's, else this one)")


def _submit_parser(sub) -> None:
    p = sub.add_parser("submit",
                       help="submit a multi-node training job (SLURM, or a hostfile for DeepSpeed's launcher)")
    _add_run_options(p)
    p.add_argument("--run-dir", required=True, help="run directory on storage every node sees")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes of the cluster profile's kind")
    _add_cluster_options(p)
    p.add_argument("--grace", type=positive_int, help="seconds between SLURM's USR1 and the time limit (default: "
                   "what plan estimates a step and a save need, at least 120)")
    p.add_argument("--depends-on", help="start after this job id ends (afterany)")
    p.add_argument("--hostfile", help="no SLURM: launch with DeepSpeed's launcher over this hostfile")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--dry-run", action="store_true", help="print the job script only")
    what.add_argument("--write", metavar="FILE", help="write the job script and make its log directory; submit nothing")
    p.set_defaults(func=cmd_submit)


def _status_parser(sub) -> None:
    from mhf_dist.cluster.status import DEFAULT_WATCH_S, STALE_HELP, positive_number

    p = sub.add_parser("status", help="a run's progress: step, loss, throughput, ETA, checkpoint, SLURM job; "
                       "flags a stalled run", description="Read a run directory (no process needs to run there): "
                       "step, tokens, loss, tokens/s, MFU, time since the last logged step (STALE past a threshold), "
                       "ETA, newest complete checkpoint whose files check out (and those that do not), validation, "
                       "divergence counters, the run lock's holder (gone or not), and the SLURM job of a submitted "
                       "run (scontrol/sacct when present). Exits 2 if RUN_DIR is not a run directory.")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="the --run-dir of `mhf-dist train` or `submit`")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys listed in mhf_dist/cluster/status.py; one line per refresh with "
                   "--watch)")
    p.add_argument("--watch", nargs="?", const=str(DEFAULT_WATCH_S), metavar="SECONDS",
                   help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) until Ctrl-C")
    p.add_argument("--stale-minutes", type=positive_number, metavar="MINUTES", help=STALE_HELP)
    p.add_argument("--verify", action="store_true", help="check the checkpoints' SHA-256 digests too, not only their "
                   "files' sizes (reads every file of the newest ones, as a resume does)")
    p.set_defaults(func=cmd_status)


def _profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="tokens/s, MFU, memory and communication per hash configuration and layout")
    p.add_argument("--size", default="100m", help=", ".join(SIZES))
    p.add_argument("--hash", default="standard,h1b16k,h3b10k,h4b16k",
                   help="comma-separated preset variants; +engram adds the Engram memory, e.g. h4b16k,h4b16k+engram")
    p.add_argument("--layout", default="tp=1", help="comma-separated tensor-parallel layouts, e.g. tp=1,tp=2")
    p.add_argument("--steps", type=positive_int, default=3, help="measured training steps per configuration")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="unmeasured steps before the measured ones")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per sequence")
    p.add_argument("--micro-batch", type=positive_int, default=1, help="sequences per step per rank")
    _add_dtype(p)
    p.add_argument("--cluster", help="profile whose nominal peak is reported next to the measured one")
    p.add_argument("--vocab-sizes", default="32768,131072,1048576", help="registered tokens for the scoring benchmark")
    p.add_argument("--out", default="profile", help="output directory")
    p.add_argument("--trace", action="store_true", help="write a PyTorch profiler trace of the first configuration")
    _add_overrides(p, "config overrides applied to every configuration")
    p.set_defaults(func=cmd_profile)


def _profile_worker_parser(sub) -> None:
    p = sub.add_parser("profile-worker")  # the ranks of one tensor-parallel layout, started by `profile`
    p.add_argument("--rows", required=True, help="where rank 0 writes its measurements (JSON)")
    p.add_argument("--spec", required=True, help="JSON of profile_training's arguments")
    p.set_defaults(func=cmd_profile_worker)


def _config_parser(sub) -> None:
    p = sub.add_parser("config", help="print the resolved run config")
    _add_run_options(p)
    p.set_defaults(func=cmd_config)


def _presets_parser(sub) -> None:
    p = sub.add_parser("presets", help="list the canonical presets")
    p.set_defaults(func=cmd_presets)


def _gpu_check_parser(sub) -> None:
    from mhf_dist.commands import gpu_check  # the standard library only, until it runs

    p = sub.add_parser("gpu-check", help="the main job end to end on one GPU (or tiny, on CPU: --cpu), as one dated "
                       "table", description=gpu_check.__doc__)
    gpu_check.add_arguments(p)
    p.set_defaults(func=gpu_check.run)


def _tokenizer_parser(sub) -> None:
    tok = sub.add_parser("tokenizer", help="offline tokenizers").add_subparsers(dest="tokenizer_command", required=True)
    p = tok.add_parser("train", help="train a byte-level BPE on local text")
    p.add_argument("--input", nargs="+", required=True, help="text files (.txt or .txt.gz)")
    p.add_argument("--vocab-size", type=positive_int, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_tokenizer_train)
    p = tok.add_parser("mistral-v0.3", help="write the paper's tokenizer (needs mistral-common)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_tokenizer_mistral)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default after its help, where it has one worth saying (not an unset
    value, a switch or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = action.default is None or action.default == [] or action.default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings or action.nargs == 0:  # a switch says what it does
            return action.help
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every command's parser (subcommands take the class of their parent) with :class:`_HelpFormatter`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhf-dist", description=DESCRIPTION, epilog=EXAMPLES)
    parser.add_argument("--version", action="version", version=f"mhf-dist {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")  # commands without help= are unlisted
    for add in (_train_parser, _prepare_data_parser, _plan_parser, _export_parser, _export_hf_parser,
                _import_hf_parser, _generate_parser, _eval_parser, _expand_vocab_parser, _submit_parser,
                _submit_data_parser, _status_parser, _profile_parser, _profile_worker_parser, _gpu_check_parser,
                _config_parser, _presets_parser, _tokenizer_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MhfError as e:
        if args.debug:
            raise
        print(f"mhf-dist{_rank_label()}: {e}", file=sys.stderr)
        return ERROR_EXIT_CODE
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, yaml.YAMLError) as e:  # unreadable or malformed files
        if args.debug:
            raise
        print(f"mhf-dist{_rank_label()}: {_describe(e)} (--debug shows where)", file=sys.stderr)
        return ERROR_EXIT_CODE


def _rank_label() -> str:
    """`` [rank N]`` in a job of several ranks (whose errors share one log), else nothing."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    return f" [rank {rank}]" if rank is not None and world != "1" else ""


def _describe(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or type(e).__name__}: {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "")
    return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    sys.exit(main())

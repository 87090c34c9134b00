"""``mhf-dist`` command line: parse, validate the config, call one function. Each command's options and what it
calls are in one module of this package; this one assembles the parser and reports errors."""

from __future__ import annotations

import argparse
import json
import os
import select
import sys

import yaml

from mhf_dist import __version__
from mhf_dist.cli import data, jobs, models, planning, train
from mhf_dist.cli.options import rank_label
from mhf_dist.cli.train import RANK_PRELOAD
from mhf_dist.errors import ERROR_EXIT_CODE, MhfError

__all__ = ["EXAMPLES", "RANK_PRELOAD", "build_parser", "main"]


DESCRIPTION = """\
Distributed training for MultiHashFormer language models: each token is a
signature of H hash coordinates into H bucket tables instead of an embedding
row. Tensor, pipeline and ZeRO data parallelism on DeepSpeed; sharded
checkpoints that resume after preemption; SLURM jobs; export to Hugging Face."""


EXAMPLES = """\
examples:
  mhf-dist train --preset tiny-h4b16k --nproc-per-node 2 --run-dir runs/tiny
  mhf-dist status runs/tiny
  mhf-dist plot runs/tiny --out runs/tiny.png
  mhf-dist plan --preset 3b-h4b16k --cluster a100-80g --nodes 4
  mhf-dist submit --preset 1b-h4b16k --set data.path=/shared/shards --cluster a100-80g --nodes 2 \\
      --partition gpu --time 24:00:00 --run-dir /shared/runs/1b
  mhf-dist export-hf runs/tiny runs/tiny-hf && mhf-dist generate --model runs/tiny-hf --prompt "In the beginning"

`mhf-dist COMMAND --help` describes a command's options."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default after its help, where it has one worth saying (not an unset
    value, a switch or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        unset = (
            action.default is None or action.default == [] or action.default == argparse.SUPPRESS
        )
        if (
            "default" in text or unset or not action.option_strings or action.nargs == 0
        ):  # a switch says what it does
            return action.help
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every command's parser (subcommands take the class of their parent) with ``_HelpFormatter``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhf-dist", description=DESCRIPTION, epilog=EXAMPLES)
    parser.add_argument("--version", action="version", version=f"mhf-dist {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    # commands without help= are unlisted
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        train.train_parser,
        data.prepare_data_parser,
        planning.plan_parser,
        models.export_parser,
        models.export_hf_parser,
        models.import_hf_parser,
        models.generate_parser,
        models.eval_parser,
        models.expand_vocab_parser,
        jobs.submit_parser,
        jobs.submit_data_parser,
        jobs.status_parser,
        jobs.elastic_plan_parser,
        jobs.requeue_parser,
        planning.profile_parser,
        planning.profile_worker_parser,
        planning.gpu_check_parser,
        planning.config_parser,
        planning.presets_parser,
        planning.plot_parser,
        data.tokenizer_parser,
    ):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at the interpreter's exit
        return rc
    except MhfError as e:
        if args.debug:
            raise
        print(f"mhf-dist{rank_label()}: {e}", file=sys.stderr)
        return ERROR_EXIT_CODE
    except (
        OSError,
        json.JSONDecodeError,
        UnicodeDecodeError,
        yaml.YAMLError,
    ) as e:  # unreadable or malformed files
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            return _quiet_after_closed_stdout()
        if args.debug:
            raise
        print(f"mhf-dist{rank_label()}: {_describe(e)} (--debug shows where)", file=sys.stderr)
        return ERROR_EXIT_CODE


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``mhf-dist status --json | head -1``)."""
    if not hasattr(select, "poll"):  # Windows: a broken pipe there is most likely stdout's
        return True
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
    except (OSError, ValueError):  # no file behind stdout: the pipe was another
        return False
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _quiet_after_closed_stdout() -> int:
    """The reader of stdout has all it wanted: a normal end (exit 0), with nothing more written and no error at
    exit, as when Python flushes stdout once more."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return 0


def _describe(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename:
        return f"{e.strerror or type(e).__name__}: {e.filename}" + (
            f" -> {e.filename2}" if e.filename2 else ""
        )
    return f"{type(e).__name__}: {e}"

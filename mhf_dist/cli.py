"""``mhf-dist`` command line: parse, validate the config, call one function."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mhf_dist.config import ConfigError, load_config, preset_names


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="{size}-{variant}, e.g. tiny-h4b16k, 100m-standard+4l, 3b-h4b16k")
    p.add_argument("--config", help="run YAML (may name a `preset:` to start from)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set model.hash.num_buckets=4096 (repeatable)")


def _load(args) -> "RunConfig":  # noqa: F821
    return load_config(args.preset, args.config, args.overrides)


def cmd_train(args) -> int:
    from mhf_dist.train.loop import train

    cfg = _load(args)
    records = train(cfg, args.run_dir)
    last = records[-1]
    print(f"done: {len(records) and last['step']} steps, loss {last['loss']:.4f}, "
          f"{last['tokens_per_s']:.0f} tokens/s; run directory {Path(args.run_dir).resolve()}")
    return 0


def cmd_config(args) -> int:
    import yaml

    print(yaml.safe_dump(_load(args).model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_presets(args) -> int:
    print("\n".join(preset_names()))
    return 0


def cmd_tokenizer_train(args) -> int:
    from mhf_dist.tokenizers import read_text_files, train_bpe

    out = train_bpe(read_text_files(args.input), args.vocab_size, args.out)
    print(f"wrote a {args.vocab_size}-token byte-level BPE to {out}")
    return 0


def cmd_tokenizer_mistral(args) -> int:
    from mhf_dist.tokenizers import load_tokenizer, write_mistral_v03

    out = write_mistral_v03(args.out)
    print(f"wrote Mistral v0.3 ({len(load_tokenizer(out))} pieces) to {out}")
    return 0


def cmd_prepare_data(args) -> int:
    from mhf_dist.data.prepare import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhf-dist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (single process for now)")
    _add_run_options(p)
    p.add_argument("--run-dir", required=True, help="run directory (created if missing)")
    p.set_defaults(func=cmd_train)

    from mhf_dist.data.prepare import add_arguments as add_prepare_arguments

    p = sub.add_parser("prepare-data", help="tokenize text into WebDataset shards of packed sequences + manifest")
    add_prepare_arguments(p)
    p.set_defaults(func=cmd_prepare_data)

    p = sub.add_parser("config", help="print the resolved run config")
    _add_run_options(p)
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("presets", help="list the canonical presets")
    p.set_defaults(func=cmd_presets)

    tok = sub.add_parser("tokenizer", help="offline tokenizers").add_subparsers(dest="tokenizer_command", required=True)
    p = tok.add_parser("train", help="train a byte-level BPE on local text")
    p.add_argument("--input", nargs="+", required=True, help="text files (.txt or .txt.gz)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_tokenizer_train)
    p = tok.add_parser("mistral-v0.3", help="write the paper's tokenizer (needs mistral-common)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_tokenizer_mistral)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"mhf-dist: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``prepare-data`` and ``tokenizer``: data and tokenizers."""

from __future__ import annotations

import os

from mhf_dist.cli.options import add_overwrite, add_preparation_options, part_of, positive_int


def cmd_prepare_data(args) -> int:
    from mhf_dist.commands.prepare_data import run

    return run(args)


def prepare_data_parser(sub) -> None:
    p = sub.add_parser(
        "prepare-data",
        help="tokenize text into WebDataset shards of packed sequences + manifest",
        usage="%(prog)s INPUTS... --tokenizer DIR --out DIR --seq-len L [--part I/N] [options]\n"
        "       %(prog)s --merge OUT PART_DIRS... [--overwrite]",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        help="text files, directories (their files, sorted) or globs: .txt "
        "(blank-line separated documents) or .jsonl (one document per line), optionally .gz or .zst, and "
        ".parquet (one document per row); .zst and .parquet need pip install 'mhf-dist[data]'. With "
        "--merge: the part directories",
    )
    p.add_argument(
        "--tokenizer", help="tokenizer directory, or mistral-v0.3 (required unless --merge)"
    )
    p.add_argument(
        "--out",
        help="output directory (new or empty; see --overwrite; required unless --merge), or a "
        "directory of object storage (s3://bucket/shards: prepared locally, then uploaded)",
    )
    add_overwrite(p)
    p.add_argument(
        "--seq-len",
        type=positive_int,
        help="model sequence length; samples hold seq_len + 1 ids (required unless --merge)",
    )
    p.add_argument(
        "--part",
        type=part_of,
        metavar="I/N",
        help="prepare only part I (1..N) of N contiguous runs of the input files, into OUT/part-I-of-N "
        "(a job array's task I of N); merge the parts with --merge",
    )
    p.add_argument(
        "--merge",
        metavar="OUT",
        help="write one manifest over the parts (directories inside OUT, given "
        "as the inputs) into OUT, shards left in place; it trains as a one-process preparation would. OUT may "
        "be a directory of object storage (s3://bucket/shards) holding parts prepared with --out there",
    )
    add_preparation_options(p)
    p.add_argument(
        "--workers",
        type=positive_int,
        default=os.cpu_count() or 1,
        help="tokenizer processes (default: all cores)",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(func=cmd_prepare_data)


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


def tokenizer_parser(sub) -> None:
    tok = sub.add_parser("tokenizer", help="offline tokenizers").add_subparsers(
        dest="tokenizer_command", required=True
    )
    p = tok.add_parser("train", help="train a byte-level BPE on local text")
    p.add_argument("--input", nargs="+", required=True, help="text files (.txt or .txt.gz)")
    p.add_argument("--vocab-size", type=positive_int, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_tokenizer_train)
    p = tok.add_parser("mistral-v0.3", help="write the paper's tokenizer (needs mistral-common)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_tokenizer_mistral)

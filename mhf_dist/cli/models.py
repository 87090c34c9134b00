"""``export``, ``export-hf``, ``import-hf``, ``generate``, ``eval`` and ``expand-vocab``: models out, in and used."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mhf_dist.cli.options import (
    add_checkpoint,
    add_dtype,
    add_model_options,
    add_overrides,
    add_overwrite,
    non_negative_int,
    positive_int,
)
from mhf_dist.config import ConfigError


def cmd_export(args) -> int:
    from mhf_dist.commands.export import export

    print(f"wrote {export(args.checkpoint, args.out, args.dtype, args.overwrite)}")
    return 0


def export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="one full state dict (safetensors) + config + signatures + tokenizer "
        "from a sharded checkpoint",
    )
    add_checkpoint(p)
    p.add_argument("--out", required=True)
    add_dtype(p)
    add_overwrite(p)
    p.set_defaults(func=cmd_export)


def cmd_export_hf(args) -> int:
    from mhf_dist.hf.exporter import export_hf

    out = export_hf(
        args.checkpoint, args.out_dir, args.dtype, args.overwrite, args.inference_temperature
    )
    print(
        f"wrote {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)"
    )
    return 0


def export_hf_parser(sub) -> None:
    p = sub.add_parser(
        "export-hf",
        help="a Hugging Face model directory (the authors' layout) from a "
        "checkpoint; logits are log P_inf",
    )
    add_checkpoint(p)
    p.add_argument("out_dir")
    add_dtype(p)
    add_overwrite(p)
    p.add_argument(
        "--inference-temperature",
        metavar="TAU|auto",
        help="τ of the exported logits log_softmax(τ · log P_inf) (config.json's inference_temperature); "
        "auto: the val_temperature training fitted last (at or before the checkpoint's step), else one "
        "fitted on the run's validation split; default: the run config's inference.temperature (1). "
        "A Standard model exports only with 1",
    )
    p.set_defaults(func=cmd_export_hf)


def cmd_import_hf(args) -> int:
    from mhf_dist.hf.importer import import_hf

    report = import_hf(args.dir, args.run_dir, args.overrides, args.overwrite)
    print(report.summary())
    print(
        f"continue with: mhf-dist train --run-dir {args.run_dir} --config {Path(args.run_dir) / 'config.yaml'}"
    )
    return 0


def import_hf_parser(sub) -> None:
    p = sub.add_parser(
        "import-hf",
        help="a run directory to continue training from a model in the authors' "
        "layout (their releases or export-hf); lists signature differences",
    )
    p.add_argument("dir", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--run-dir", required=True, help="new run directory")
    add_overrides(p, "override the imported run config, e.g. --set data.path=SHARDS (repeatable)")
    add_overwrite(p)
    p.set_defaults(func=cmd_import_hf)


def cmd_generate(args) -> int:
    from mhf_dist.commands.generate import generate, load_for_inference

    model, tokenizer = load_for_inference(
        args.model, args.dtype, args.device, args.trust_remote_code
    )
    stream = not args.json and args.num_beams == 1  # beam search settles its text only at the end
    ids = generate(
        model,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        num_beams=args.num_beams,
        seed=args.seed,
        compile=args.compile,
        on_text=(lambda piece: print(piece, end="", flush=True)) if stream else None,
    )
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                {
                    "model": str(args.model),
                    "prompt": args.prompt,
                    "completion": text,
                    "new_tokens": len(ids),
                }
            )
        )
    else:
        print("" if stream else args.prompt + text)
    return 0


def generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text under P_inf (greedy, temperature, top-k, top-p, beams)"
    )
    add_model_options(p)
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=50,
        help="tokens to generate after the prompt (at most what the model's positions leave)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--top-p", type=float)
    p.add_argument(
        "--num-beams",
        type=positive_int,
        default=1,
        help="beam search width (1: greedy or sampling)",
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed of sampling")
    p.add_argument(
        "--compile",
        action="store_true",
        help="static KV cache and a compiled decode step (CUDA graphs on GPUs); compiling takes a while",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end (model, prompt, completion, "
        "new_tokens) instead of the text as it is generated",
    )
    p.set_defaults(func=cmd_generate)


def cmd_eval(args) -> int:
    from mhf_dist.commands.evaluate import last_word_accuracy, perplexity
    from mhf_dist.commands.generate import load_for_inference

    if not (args.data or args.lambada):
        raise ConfigError("nothing to evaluate: pass --data SHARDS and/or --lambada FILE.jsonl")
    model, tokenizer = load_for_inference(
        args.model, args.dtype, args.device, args.trust_remote_code
    )
    results = {"model": str(args.model)}
    if args.data:
        calibrate = args.calibrate or args.calibration_split is not None
        if calibrate and (args.calibration_split or args.split) == args.split:
            print(
                f"note: τ is fitted on the evaluated split ({args.split}), so its calibrated perplexity is "
                "optimistic; fit it on another split with --calibration-split",
                file=sys.stderr,
            )
        results["perplexity"] = perplexity(
            model,
            tokenizer,
            args.data,
            split=args.split,
            max_sequences=args.max_sequences,
            batch_size=args.batch_size,
            calibrate=calibrate,
            calibration_split=args.calibration_split,
            document_masking={"auto": None, "on": True, "off": False}[args.document_masking],
        )
    if args.lambada:
        results["last_word"] = last_word_accuracy(model, tokenizer, args.lambada)
    text = json.dumps(results, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="perplexity on shards and LAMBADA-style last-word accuracy, under P_inf"
    )
    add_model_options(p)
    p.add_argument("--data", help="shard directory (made with the model's tokenizer)")
    p.add_argument("--split", default="val", help="split of the shards to evaluate (val or train)")
    p.add_argument(
        "--max-sequences",
        type=positive_int,
        help="evaluate (and calibrate on) at most this many sequences of the split",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the temperature τ of P_τ ∝ P_inf^τ on --calibration-split and report the calibrated "
        "perplexity at it (without: at the model's own inference_temperature)",
    )
    p.add_argument(
        "--calibration-split",
        metavar="SPLIT",
        help="the split τ is fitted on (implies --calibrate; default: --split itself, which is optimistic)",
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass")
    p.add_argument(
        "--document-masking",
        choices=("auto", "on", "off"),
        default="auto",
        help="on: read each document of a row apart and leave out an EOS's next token, as a run with "
        "data.document_masking measures val_loss; off: every row as one sequence; auto (default): as the "
        "model was trained (its config's document_masking)",
    )
    p.add_argument("--lambada", help='JSONL of {"text": ...}; the target is the last word')
    p.add_argument("--out", help="also write the results (JSON) here")
    p.set_defaults(func=cmd_eval)


def cmd_expand_vocab(args) -> int:
    from mhf_dist.commands.expand_vocab import expand_vocab

    print(
        expand_vocab(
            args.run_dir,
            args.tokenizer,
            args.out,
            args.trainable_blocks,
            args.overrides,
            args.overwrite,
        ).summary()
    )
    return 0


def expand_vocab_parser(sub) -> None:
    p = sub.add_parser(
        "expand-vocab",
        help="register a superset tokenizer's new tokens (MHF: 0 new parameters) "
        "into a new run directory that continues training",
    )
    p.add_argument(
        "--run-dir", required=True, help="the trained run (its newest checkpoint is used)"
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="the new tokenizer directory (old ids kept, tokens appended)",
    )
    p.add_argument("--out", help="new run directory (default: RUN_DIR-vocab<V>)")
    p.add_argument(
        "--trainable-blocks",
        type=non_negative_int,
        help="train only the vocabulary side, the final norm and the first and last k blocks (the paper's "
        "expansion stage); default: everything",
    )
    add_overrides(p, "override the new run's config, e.g. --set train.max_steps=1000 (repeatable)")
    add_overwrite(p)
    p.set_defaults(func=cmd_expand_vocab)

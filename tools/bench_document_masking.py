"""Benchmark: what ``data.document_masking`` costs attention and a backbone block (docs/design-model.md, "Document
masking").

At a preset's backbone shapes (default ``100m``: d 768, 12 query heads, 2 k/v heads of 64), one row of ``--seq`` tokens
(default 2048) holding documents of ``--docs`` lengths, forward and backward, side by side in rounds (each round runs
each way once, in a rotating order, so a machine whose speed drifts slows all alike):

- attention alone (``q, k, v`` after RoPE): ``causal`` (masking off: ``is_causal``, grouped k/v heads), ``additive``
  (what the model runs with masking: the documents' additive bias made once, k/v heads repeated,
  ``document_attention``), ``bool`` (the boolean mask handed to ``scaled_dot_product_attention`` with grouped heads,
  which converts it at every call), ``varlen`` (one causal call per document: it needs the documents' bounds on the
  host, a sync per row on a GPU) and ``flex`` (``flex_attention`` with a block mask, where the device supports its
  backward);
- one backbone block with its ``BlockInputs`` (``block_inputs``): ``block-off`` and ``block-on``; and the making of
  the masked ``BlockInputs`` alone (``inputs-on``), which a forward does once for all its blocks;
- with ``--models``, each named preset's whole training forward (its loss, EOS inputs' targets left out with
  masking: ``targets_of``) and backward, masking off and on (``<preset>-off``, ``<preset>-on``), on the profile's
  random signatures (``probe_model``).

Reports the median and the minimum wall seconds and the median CPU seconds of the process (the work, which other
tenants of a shared machine disturb less) of each, and their ratios to ``causal`` / ``block-off``.

Usage: python tools/bench_document_masking.py [--preset 100m-standard] [--seq 2048] [--docs 700,300,500,548]
[--rounds 9] [--threads 2] [--device cpu] [--models 100m-h4b16k,100m-standard] [--only-models]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from mhf_dist.config import load_config
from mhf_dist.model.backbone import Block, block_inputs, document_attention
from mhf_dist.model.documents import document_mask, document_positions, targets_of
from mhf_dist.model.modes import ModelModes
from mhf_dist.profiling.training import probe_model

EOS = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="100m-standard")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--docs", default="700,300,500,548", help="document lengths (EOS included)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--models", default="", help="presets whose whole step is timed too (comma-separated)"
    )
    ap.add_argument("--only-models", action="store_true", help="time the presets' steps alone")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = load_config(args.preset).model
    lengths = [int(n) for n in args.docs.split(",")]
    if sum(lengths) != args.seq:
        raise SystemExit(f"--docs add up to {sum(lengths)}, not --seq {args.seq}")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 1000, (1, args.seq), generator=gen)
    ids[0, torch.tensor(lengths).cumsum(0)[:-1] - 1] = EOS
    ids = ids.to(device)
    hd, heads, kv = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
    q0, k0, v0 = (
        torch.randn(1, n, args.seq, hd, generator=gen).to(device) for n in (heads, kv, kv)
    )
    grad = torch.randn(1, heads, args.seq, hd, generator=gen).to(device)
    positions = document_positions(ids, EOS)
    mask = document_mask(positions)
    on = block_inputs(q0.new_empty(1, args.seq, 1), ids, hd, cfg.rope_theta, EOS)

    def attention(fn):
        def run():
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            fn(q, k, v).backward(grad)

        return run

    def varlen(q, k, v):
        outs, start = [], 0
        for n in lengths:
            part = slice(start, start + n)
            start += n
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, part], k[:, :, part], v[:, :, part], is_causal=True, enable_gqa=True
                )
            )
        return torch.cat(outs, dim=2)

    ways = {
        "causal": attention(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        ),
        "additive": attention(lambda q, k, v: document_attention(q, k, v, on.mask)),
        "bool": attention(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        ),
        "varlen": attention(varlen),
    }
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        starts = (torch.arange(args.seq, device=device) - positions)[0]
        block_mask = create_block_mask(
            lambda b, h, qi, ki: (ki <= qi) & (ki >= starts[qi]),
            1,
            None,
            args.seq,
            args.seq,
            device=str(device),
        )
        flex = attention(
            lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        )
        flex()
        ways["flex"] = flex
    except Exception as e:  # noqa: BLE001 (reported, then left out)
        print(f"flex: not run ({type(e).__name__}: {str(e).splitlines()[0]})")

    block = Block(cfg).to(device)
    x0 = torch.randn(1, args.seq, cfg.d_model, generator=gen).to(device)
    off = block_inputs(x0, ids, hd, cfg.rope_theta)

    def block_run(inputs):
        def run():
            x = x0.clone().requires_grad_()
            block(x, inputs.cos, inputs.sin, ids, inputs.positions, inputs.mask).sum().backward()

        return run

    ways["block-off"] = block_run(off)
    ways["block-on"] = block_run(on)
    ways["inputs-on"] = lambda: block_inputs(x0, ids, hd, cfg.rope_theta, EOS)
    if args.only_models:
        ways.clear()
    row = ids[0, : args.seq - 1]
    batch = torch.cat([row, torch.randint(2, 1000, (1,), generator=gen).to(device)])[None]
    for preset in filter(None, args.models.split(",")):
        for name, eos in (("off", None), ("on", EOS)):
            model, _ = probe_model(
                load_config(preset).model, 1, device, torch.float32, ModelModes(document_eos=eos)
            )

            def step(model=model, eos=eos):
                model.zero_grad(set_to_none=True)
                model(batch[:, :-1], targets_of(batch, eos)).loss.backward()

            ways[f"{preset}-{name}"] = step

    wall: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    names = list(ways)
    for fn in ways.values():  # warm-up
        fn()
    for r in range(args.rounds):
        for w in names[r % len(names) :] + names[: r % len(names)]:
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t, c = time.perf_counter(), time.process_time()
            ways[w]()
            sync()
            wall[w].append(time.perf_counter() - t)
            cpu[w].append(time.process_time() - c)
    print(
        f"{args.preset} shapes (d {cfg.d_model}, {heads} q / {kv} kv heads of {hd}), 1 x {args.seq} tokens, "
        f"documents {lengths}, {args.threads} threads, {args.rounds} rounds, forward + backward"
    )
    print(f"{'way':20s} {'median ms':>10s} {'min ms':>8s} {'cpu ms':>8s} {'ratio':>6s}")
    for w in names:
        base = (
            "block-off"
            if w.startswith(("block", "inputs"))
            else w.rsplit("-", 1)[0] + "-off"
            if w.endswith(("-off", "-on"))
            else "causal"
        )
        median = statistics.median(wall[w])
        ratio = median / statistics.median(wall[base])
        print(
            f"{w:20s} {median * 1e3:10.1f} {min(wall[w]) * 1e3:8.1f} "
            f"{statistics.median(cpu[w]) * 1e3:8.1f} {ratio:6.2f}"
        )


if __name__ == "__main__":
    main()

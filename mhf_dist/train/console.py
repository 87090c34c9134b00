"""The line rank 0 prints for each logged step, in units people read:

``step 20/200 | loss 28.37 | grad 1.9 | lr 4.9e-05 | 600 tok/s | mfu 9.8% | mem 2.1 GB | 0.85 s/step | eta 2 min``

(with several ranks ``slowest r3 1.04x`` before the ETA: the rank with the most compute time per step, against the
median of its pipeline stage's other ranks, and with the device probe ``device r1 1.01x``: the rank whose device took
longest for the probe's fixed work, against the median of the others, ``mhf_dist.train.stragglers``)

and, at evaluations, the validation perplexities and the downstream tasks' scores (``train.eval_tasks``: ``TASK METRIC
value``). ``metrics.jsonl`` keeps every value at full precision.
"""

from __future__ import annotations


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3 h 05 min``, ``2 d 4 h``."""
    s = round(seconds)
    if s < 90:
        return f"{s} s"
    minutes = round(s / 60)
    if minutes < 90:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


# (record key, how it reads): the training measures first, then the evaluation's
_FIELDS = (
    ("loss", lambda v: f"loss {v:.4g}"),
    ("grad_norm", lambda v: f"grad {v:.3g}"),
    ("lr", lambda v: f"lr {v:.2g}"),
    ("tokens_per_s", lambda v: f"{v:,.0f} tok/s"),
    ("mfu", lambda v: f"mfu {v:.1%}"),
    ("memory_gb", lambda v: f"mem {v:.1f} GB"),
    ("step_s", lambda v: f"{v:.3g} s/step"),
    ("val_loss", lambda v: f"val_loss {v:.4g}"),
    ("val_ppl", lambda v: f"val_ppl {v:.4g}"),
    ("val_ppl_calibrated", lambda v: f"val_ppl_calibrated {v:.4g}"),
)


def step_line(step: int, total: int, record: dict, seconds_left: float | None) -> str:
    """``record`` (a logged step's metrics) as one console line; ``seconds_left``: the ETA, when known."""
    parts = [f"step {step}/{total}"] + [
        show(record[key]) for key, show in _FIELDS if record.get(key) is not None
    ]
    # steps that applied no update (a spike left out, or an overflow)
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    # ranks' own compute time: the slowest against the others
    if record.get("slowest_ratio") is not None:
        parts.append(f"slowest r{record['slowest_rank']} {record['slowest_ratio']:.2f}x")
    # the device probe's: the slowest device against the others
    if record.get("slowest_device_ratio") is not None:
        parts.append(
            f"device r{record['slowest_device_rank']} {record['slowest_device_ratio']:.2f}x"
        )
    # train.eval_tasks' scores: eval/<task>/<metric>
    parts += [
        f"{key.removeprefix('eval/').replace('/', ' ')} {value:.4g}"
        for key, value in record.items()
        if key.startswith("eval/") and isinstance(value, (int, float))
    ]
    if seconds_left is not None:
        parts.append(f"eta {duration(seconds_left)}")
    return " | ".join(parts)

"""The single-process training loop and `mhf-dist train`: loss falls on real text, run directory contents."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.train.loop import train


def test_tiny_mhf_loss_falls_on_real_text(tmp_path):
    cfg = load_config("tiny-h4b16k", overrides=[
        "model.hash.num_buckets=256", "tokenizer.vocab_size=1024", "data.seq_len=64",
        "train.max_steps=200", "train.log_interval=20", "optimizer.lr=3e-3",
    ])
    records = train(cfg, tmp_path / "run")
    first, last = records[0], sum(r["loss"] for r in records[-2:]) / 2
    # step 1 sits at the uniform loss H·ln(B) = 4·ln(256) = 22.18; a model that learns nothing stays there
    assert first["step"] == 1 and abs(first["loss"] - 22.18) < 0.5
    assert last < first["loss"] - 2.5, (first["loss"], last)


def test_train_cli_writes_metrics_and_tensorboard(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(["train", "--preset", "tiny-h4b16k", "--run-dir", str(run), "--set", "model.hash.num_buckets=128",
               "--set", "train.max_steps=4", "--set", "train.log_interval=2", "--set", "train.global_batch_size=4",
               "--set", "train.micro_batch_size=2", "--set", "tokenizer.vocab_size=512"])
    assert rc == 0
    assert "tokens/s" in capsys.readouterr().out
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 4]
    for l in lines:
        assert {"step", "loss", "head_losses", "lr", "tokens_per_s"} <= set(l) and len(l["head_losses"]) == 4
        assert abs(sum(l["head_losses"]) - l["loss"]) < 1e-4
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {"loss", "lr", "tokens_per_s", "head_losses/0", "head_losses/3"} <= set(acc.Tags()["scalars"])
    assert (run / "signatures" / "signatures.json").is_file() and (run / "config.yaml").is_file()


def test_bad_config_exits_with_named_error(tmp_path, capsys):
    rc = main(["train", "--preset", "tiny-h4b16k", "--run-dir", str(tmp_path), "--set", "model.d_model=65"])
    assert rc == 2
    assert "model.d_model=65 is not divisible by model.n_heads=4" in capsys.readouterr().err

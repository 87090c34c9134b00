"""Resuming a run: its own config.yaml, a longer schedule, other data from its beginning, what a resume refuses, a
checkpoint of the previous version, and the client state's parts."""

from __future__ import annotations

import gzip
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from helpers.runs import metrics, run_cli, train_args, train_run
from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.data.reader import ShardReader
from mhf_dist.train.client_state import ClientState
from mhf_dist.train.optim import lr_factor
from mhf_dist.vocab.tokenizers import embedded_corpus, load_tokenizer, train_bpe

GOLDEN = Path(__file__).parent / "golden" / "checkpoint-a105062"  # made by its make.sh
# a computation's fp32 results on two kinds of CPU: a few units in the last place, compounded over four steps
ROUNDING_RTOL = 1e-5
WARMUP = "optimizer.warmup_steps=1"  # the schedule leaves warm-up at once, so its end (lr 0 at step 4) shows


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A one-rank run trained to its end, step 3 (data.restart given without a checkpoint: it does nothing)."""
    root = tmp_path_factory.mktemp("finished")
    train_run(root, data, "run", 1, "parallel.zero_stage=1", WARMUP, "data.restart=true", steps=3)
    return root / "run"


@pytest.fixture(scope="module")
def other_shards(tmp_path_factory, data):
    """Shards of another text (the embedded corpus's first 200,000 characters) for the same tokenizer and seq_len."""
    root = tmp_path_factory.mktemp("other")
    text = root / "genesis.txt"
    with gzip.open("mhf_dist/data/corpus/kjv.txt.gz", "rt") as f:
        text.write_text(f.read()[:200_000])
    assert (
        main(
            [
                "prepare-data",
                str(text),
                "--tokenizer",
                str(data["tokenizer"]),
                "--out",
                str(root / "shards"),
                "--seq-len",
                "64",
                "--samples-per-shard",
                "32",
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    return root / "shards"


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


def reader_position(checkpoint: Path) -> dict:
    """The data position a checkpoint saved (our client state, inside DeepSpeed's model-states file)."""
    return torch.load(
        checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
    )["reader"]


@pytest.mark.multirank
def test_a_raised_max_steps_sets_the_schedule_from_the_first_resumed_step(tmp_path, data, finished):
    """Past its warm-up a longer cosine run makes the learning rate jump: taken on purpose here."""
    run = copy_of(finished, tmp_path)
    jump = "optimizer.allow_lr_jump=true"
    out = run_cli(train_args(run, data, 1, "parallel.zero_stage=1", WARMUP, jump, steps=5))
    change = "changed on resume, from step 4: train.max_steps: 3 -> 5 (the learning-rate schedule now ends at step 5)"
    assert out.count(change) == 1, out[-3000:]
    cfg = load_config("tiny-h4b16k", overrides=[WARMUP]).optimizer
    lr = {r["step"]: r["lr"] for r in metrics(run)}
    assert lr[3] == pytest.approx(cfg.lr * lr_factor(2, cfg, 3))
    # the old schedule ended at 0
    assert lr[4] == pytest.approx(cfg.lr * lr_factor(3, cfg, 5)) and lr[4] > 0
    assert lr[5] == pytest.approx(cfg.lr * lr_factor(4, cfg, 5))


@pytest.mark.multirank
def test_a_run_resumes_with_its_own_config(tmp_path, finished):
    run = copy_of(finished, tmp_path)
    # no --preset, no --config
    out = run_cli(
        [
            "train",
            "--run-dir",
            str(run),
            "--set",
            "train.max_steps=4",
            "--set",
            "optimizer.allow_lr_jump=true",  # past its warm-up: a longer cosine's learning rate jumps
        ]
    )
    assert f"resumed from {run / 'checkpoints' / 'step-00000003'} at step 3" in out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 4
    assert saved["optimizer"]["allow_lr_jump"] is False  # an instruction to that start only


@pytest.mark.multirank
def test_a_resume_from_config_yaml_refuses_fields_the_checkpoint_fixes(tmp_path, finished, capsys):
    run = copy_of(finished, tmp_path)
    saved = (run / "config.yaml").read_text()
    assert (
        main(
            [
                "train",
                "--run-dir",
                str(run),
                "--set",
                "model.ffn_dim=128",
                "--set",
                "data.seq_len=32",
                "--set",
                "train.log_interval=2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "model.ffn_dim: 128, the checkpoint's is 192 (--set)" in err
    assert (
        "data.seq_len: 32, the checkpoint's is 64 (--set)" in err
        and "train.log_interval" not in err
    )

    edited = yaml.safe_load(saved)
    edited["tokenizer"]["vocab_size"] = 2048
    (run / "config.yaml").write_text(yaml.safe_dump(edited))
    assert main(["train", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert (
        f"tokenizer.vocab_size: 2048, the checkpoint's is 4096 (edited in {run / 'config.yaml'})"
        in err
    )
    assert yaml.safe_load((run / "config.yaml").read_text()) == edited  # the refusal wrote nothing


def test_a_run_directory_without_config_yaml_needs_a_preset_or_config(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "new")]) == 2
    assert (
        "holds no config.yaml to resume with; pass --preset NAME (e.g. tiny-h4b16k) or --config run.yaml"
        in (capsys.readouterr().err)
    )
    assert not (tmp_path / "new").exists()


@pytest.mark.multirank
def test_other_data_on_resume_is_read_from_its_beginning_with_data_restart(
    tmp_path, data, finished, other_shards
):
    run, other = copy_of(finished, tmp_path), dict(data, shards=other_shards)
    refused = run_cli(
        train_args(run, other, 1, "parallel.zero_stage=1", WARMUP, steps=4), expect_rc=2
    )
    assert "reader state has dataset=" in refused and "--set data.restart=true" in refused

    out = run_cli(
        train_args(
            run,
            other,
            1,
            "parallel.zero_stage=1",
            WARMUP,
            "data.restart=true",
            "optimizer.allow_lr_jump=true",  # past its warm-up: a longer cosine's learning rate jumps
            steps=4,
        )
    )
    assert (
        out.count(
            f"data.restart: from step 4 the data is read from the beginning of {other_shards}"
        )
        == 1
    )
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 3, 4]
    assert records[3]["data_restart"] is True and records[3]["data_path"] == str(other_shards)
    position = reader_position(run / "checkpoints" / "step-00000004")
    assert (position["epoch"], position["position"]) == (
        0,
        8,
    )  # one step of 8 sequences into the new data
    assert position["dataset"] == ShardReader(other_shards).fingerprint
    # one start's instruction
    assert yaml.safe_load((run / "config.yaml").read_text())["data"]["restart"] is False

    # a requeued job passes data.restart again: the position is in this data now, so it continues from it
    out = run_cli(
        train_args(
            run,
            other,
            1,
            "parallel.zero_stage=1",
            WARMUP,
            "data.restart=true",
            "optimizer.allow_lr_jump=true",
            steps=5,
        )
    )
    assert "data.restart:" not in out
    assert reader_position(run / "checkpoints" / "step-00000005")["position"] == 16


@pytest.mark.multirank
def test_data_of_another_tokenizer_on_resume_is_named_with_the_command_that_prepares_it_again(
    tmp_path, data
):
    """A run on the embedded text takes its tokenizer from RUN/tokenizer; a resume on shards that carry another
    tokenizer of the same size is refused for the data (not the signature table), with commands that work."""
    other_tok = train_bpe(list(embedded_corpus())[::3], 1024, tmp_path / "other-tok")
    text = tmp_path / "genesis.txt"
    with gzip.open("mhf_dist/data/corpus/kjv.txt.gz", "rt") as f:
        text.write_text(f.read()[:100_000])
    shards = tmp_path / "shards"
    assert (
        main(
            [
                "prepare-data",
                str(text),
                "--tokenizer",
                str(other_tok),
                "--out",
                str(shards),
                "--seq-len",
                "64",
                "--samples-per-shard",
                "32",
                "--workers",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    run = tmp_path / "run"
    run_cli(
        train_args(
            run,
            data,
            1,
            "tokenizer.path=null",
            "tokenizer.vocab_size=1024",
            "data.path=null",
            steps=1,
        )
    )
    assert len(load_tokenizer(run / "tokenizer")) == len(load_tokenizer(other_tok))

    out = run_cli(
        [
            "train",
            "--run-dir",
            str(run),
            "--set",
            f"data.path={shards}",
            "--set",
            "data.restart=true",
            "--set",
            "train.max_steps=2",
        ],
        expect_rc=2,
    )
    assert f"{shards / 'manifest.json'} was tokenized by another tokenizer" in out, out[-3000:]
    assert "signatures was built for another tokenizer" not in out
    prepare, train = [
        line.strip() for line in out.splitlines() if line.strip().startswith("mhf-dist ")
    ][-2:]
    assert prepare == shlex.join(
        [
            "mhf-dist",
            "prepare-data",
            str(text),
            "--tokenizer",
            str(run / "tokenizer"),
            "--out",
            f"{shards}-retokenized",
            "--seq-len",
            "64",
            "--samples-per-shard",
            "32",
        ]
    )
    assert train == shlex.join(
        [
            "mhf-dist",
            "train",
            "--run-dir",
            str(run),
            "--set",
            f"data.path={shards}-retokenized",
            "--set",
            "data.restart=true",
        ]
    )
    run_cli(shlex.split(prepare)[1:])
    out = run_cli([*shlex.split(train)[1:], "--set", "train.max_steps=2"])
    assert (
        f"data.restart: from step 2 the data is read from the beginning of {shards}-retokenized"
        in out
    )


@pytest.mark.multirank
def test_a_checkpoint_of_the_previous_version_resumes_as_the_uninterrupted_run(
    tmp_path, monkeypatch
):
    """tests/golden/checkpoint-a105062: a run trained to step 2 of 4 by the code of commit a105062, with its loss
    watch's window. Resumed here to step 4, it has the numbers of this version's uninterrupted run (steps 1 and 2 in
    its metrics are the old version's), and the same weights at the end: to the rounding of fp32 products, which
    MKL computes with other kernels on another kind of CPU than the one that wrote the checkpoint (on the same kind
    they are bit-identical, as within a version, ``test_stop_and_resume_is_bit_identical``); a part of the state
    restored wrong (optimizer moments, data position, schedule) moves them by orders of magnitude more."""
    from mhf_dist.backend import consolidate

    golden = Path(shutil.copytree(GOLDEN, tmp_path / "golden"))
    monkeypatch.chdir(golden)  # its config names its tokenizer and shards relative to here
    out = run_cli(["train", "--run-dir", "run", "--set", "train.stop_at_step=null"])
    assert "resumed from run/checkpoints/step-00000002 at step 2" in out, out[-3000:]
    run_cli(
        [
            "train",
            "--config",
            "run/config.yaml",
            "--run-dir",
            "whole",
            "--set",
            "train.stop_at_step=null",
        ]
    )
    resumed, whole = (
        [
            (r["step"], r["loss"], r["head_losses"], r["grad_norm"])
            for r in metrics(golden / name)
            if "loss" in r
        ]
        for name in ("run", "whole")
    )
    assert [r[0] for r in resumed] == [r[0] for r in whole] == [1, 2, 3, 4]
    torch.testing.assert_close(
        [r[1:] for r in resumed], [r[1:] for r in whole], rtol=ROUNDING_RTOL, atol=0
    )
    ends = [
        consolidate(golden / name / "checkpoints/step-00000004", pipeline=False)
        for name in ("run", "whole")
    ]
    # as a whole: Adam turns the rounding noise of a gradient that is zero in exact arithmetic (a bias before a
    # softmax, which the softmax ignores) into an update of up to the learning rate in that one weight
    assert ends[0].keys() == ends[1].keys()
    difference, size = (
        torch.cat([t.double().flatten() for t in tensors]).norm()
        for tensors in ([ends[0][k] - ends[1][k] for k in ends[1]], ends[1].values())
    )
    assert difference <= ROUNDING_RTOL * size, (difference, size)


class _Part:
    def __init__(self, **state):
        self.state = state

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def test_the_client_state_saves_its_parts_keys_in_order_and_loads_each_its_own():
    progress, watch, nothing = _Part(step=0, tokens=0), _Part(loss_watch=[]), _Part()
    state = ClientState()
    for part in (progress, nothing, watch):
        state.register(part)
    progress.state, watch.state = {"step": 5, "tokens": 40}, {"loss_watch": [1.0]}
    assert list(state.state_dict().items()) == [("step", 5), ("tokens", 40), ("loss_watch", [1.0])]
    # saved before the watch kept its window
    state.load_state_dict({"step": 2, "tokens": 16, "reader": {}})
    assert (progress.state, watch.state) == (
        {"step": 2, "tokens": 16},
        {"loss_watch": []},
    )  # the watch's start
    with pytest.raises(ValueError, match=r"client state keys \['step'\] are registered twice"):
        state.register(_Part(step=1))

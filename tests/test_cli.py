"""The command line: commands that train nothing start without the training stack."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys

import pytest

from mhf_dist.cli import build_parser
from mhf_dist.config import load_config

HEAVY = ("torch", "deepspeed", "transformers", "webdataset", "numpy", "safetensors")
PROBE = """
import json, sys
from mhf_dist.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # --help and --version exit through argparse
    rc = e.code
print(json.dumps({"rc": rc, "loaded": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


def loaded_by(*args: str, cwd=None) -> list[str]:
    """The heavy modules a fresh interpreter has loaded after running ``mhf-dist ARGS`` (which must succeed)."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=cwd
    )
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["rc"] in (0, None), proc.stdout + proc.stderr
    return report["loaded"]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["presets"],
        ["config", "--preset", "tiny-h4b16k"],
        ["submit", "--help"],
    ],
)
def test_commands_without_training_load_nothing_heavy(args):
    assert loaded_by(*args) == []


def test_status_loads_nothing_heavy(tmp_path):
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(
        yaml.safe_dump(load_config("tiny-h4b16k").model_dump(mode="json"))
    )
    assert loaded_by("status", str(run), "--json") == []


def test_plan_and_submit_do_not_load_deepspeed_or_transformers(tmp_path):
    assert (
        loaded_by(
            "submit",
            "--preset",
            "3b-h4b16k",
            "--set",
            "data.path=/shared/data",
            "--cluster",
            "a100-80g",
            "--partition",
            "gpu",
            "--time",
            "1:00:00",
            "--nodes",
            "4",
            "--run-dir",
            str(tmp_path / "r"),
            "--dry-run",
        )
        == []
    )
    loaded = loaded_by("plan", "--preset", "3b-h4b16k", "--cluster", "a100-80g", "--nodes", "4")
    # the meta-device model needs torch
    assert "deepspeed" not in loaded and "transformers" not in loaded


def test_help_lists_user_commands_with_examples(capsys):
    text = build_parser().format_help()
    assert "examples:" in text and "mhf-dist train --preset" in text and "mhf-dist status" in text
    assert "profile-worker" not in text  # internal: started by `profile` for its ranks
    for command in ("train", "status", "submit", "plan", "export-hf", "generate", "profile"):
        assert f"    {command} " in text


def test_version():
    from mhf_dist import __version__

    proc = subprocess.run(
        [sys.executable, "-m", "mhf_dist", "--version"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"mhf-dist {__version__}"


def test_every_help_example_validates_as_printed(capsys):
    """The examples under ``mhf-dist --help`` pass as printed: ``plan`` and ``submit --dry-run`` run whole, ``train``
    passes every check made before its ranks start."""
    from mhf_dist.cli import EXAMPLES, main
    from mhf_dist.train.preflight import preflight

    lines = EXAMPLES.replace("\\\n", " ").splitlines()
    commands = [
        shlex.split(line.strip())[1:] for line in lines if line.strip().startswith("mhf-dist ")
    ]
    checked = []
    for argv in commands:
        argv = argv[: argv.index("&&")] if "&&" in argv else argv
        if argv[0] == "train":
            args = build_parser().parse_args(argv)
            preflight(
                load_config(args.preset, overrides=args.overrides), args.nproc_per_node, "cpu"
            )
        elif argv[0] in ("plan", "submit"):
            assert main(argv + (["--dry-run"] if argv[0] == "submit" else [])) == 0, (
                capsys.readouterr().err
            )
        else:
            continue
        checked.append(argv[0])
    assert checked == ["train", "plan", "submit"], commands


@pytest.mark.parametrize(
    "preset, world, micro, accum",
    [
        ("tiny-h4b16k", 2, 4, 1),  # the global batch of 8 over 2 replicas: micro-batches of 4
        ("tiny-h4b16k", 8, 1, 1),
        ("3b-h4b16k", 128, 2, 1),  # 16 nodes of 8 GPUs: 256 sequences over 128 replicas
        ("1b-h4b16k", 16, 4, 4),  # the preset's micro-batch fits: kept
    ],
)
def test_a_presets_micro_batch_fits_the_layout(preset, world, micro, accum):
    from mhf_dist.parallel.layout import resolve_layout

    cfg = load_config(preset)
    layout = resolve_layout(cfg, world)
    assert (cfg.train.micro_batch_size, layout.accum) == (micro, accum)
    assert micro * layout.dp * accum == cfg.train.global_batch_size


def test_batch_sizes_that_cannot_fit_name_the_values_that_would(tmp_path):
    from mhf_dist.config import ConfigError
    from mhf_dist.parallel.layout import resolve_layout

    # kept as set: refused
    set_by_user = load_config("tiny-h4b16k", overrides=["train.micro_batch_size=8"])
    with pytest.raises(
        ConfigError,
        match=r"= 8 × 2; set train.micro_batch_size=4 or 2 or 1, or "
        r"train.global_batch_size=16$",
    ):
        resolve_layout(set_by_user, 2)
    (tmp_path / "run.yaml").write_text("preset: tiny-h4b16k\ntrain:\n  micro_batch_size: 8\n")
    with pytest.raises(ConfigError, match="micro_batch_size × dp = 8 × 2"):
        resolve_layout(load_config(path=tmp_path / "run.yaml"), 2)
    with pytest.raises(
        ConfigError, match=r"= 8 × 3; set train.global_batch_size=6 or train.global_batch_size=9$"
    ):
        resolve_layout(load_config("tiny-h4b16k"), 3)  # no micro-batch divides 8 over 3 replicas


def test_config_shows_the_fields_of_sections_that_are_off(capsys):
    import yaml

    from mhf_dist.cli import main

    assert main(["config", "--preset", "tiny-h4b16k"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["train"]["wandb"] is None  # still the config, as YAML
    for name in ("project", "entity", "name", "mode"):
        assert f"#   train.wandb.{name}: " in out


def _commands(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield name, command
                yield from _commands(command)


def test_help_shows_every_options_default():
    checked = 0
    for name, command in _commands(build_parser()):
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if (
                not action.option_strings
                or action.nargs == 0
                or action.default is None
                or action.default == []
            ):
                continue
            checked += 1
            assert f"default: {action.default}" in text or "default" in (action.help or ""), (
                name,
                action.dest,
            )
    assert checked > 20

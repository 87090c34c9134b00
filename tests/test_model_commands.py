"""Commands that read a model (import-hf, export-hf, generate, eval), on a release: a tiny MultiHashFormer saved in
the authors' layout as their releases are (config.json, weights, tokenizer; no run config of ours). It is freshly
initialised, so nothing here trains."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.hf.exporter import build_hf_model
from mhf_dist.model import build_model
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import vocabulary

PROMPT = "And God said, Let there be light"


@pytest.fixture(scope="module")
def release(tmp_path_factory, bpe):
    """A tiny MultiHashFormer (random weights) on the shared BPE, as a release directory."""
    cfg = load_config("tiny-h4b16k", overrides=["model.hash.num_buckets=256"])
    table = SignatureTable.build(
        vocabulary(bpe),
        cfg.model.hash.num_hashes,
        cfg.model.hash.num_buckets,
        pad_id=bpe.pad_token_id,
    )
    model = build_model(cfg.model, len(bpe), table.codes, seed=1)
    out = tmp_path_factory.mktemp("release")
    build_hf_model(cfg, model.state_dict(), bpe, table).save_pretrained(out)
    bpe.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def imported(release, data, tmp_path_factory):
    """The release imported into a run directory (never trained), whose data are the shared shards."""
    run = tmp_path_factory.mktemp("imported") / "run"
    assert (
        main(
            [
                "import-hf",
                str(release),
                "--run-dir",
                str(run),
                "--set",
                f"data.path={data['shards']}",
                "--set",
                "train.eval_sequences=4",
            ]
        )
        == 0
    )
    return run


def logits(model_dir, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)(ids).logits


def test_an_imported_release_exports_as_the_same_model(release, imported, tmp_path, capsys):
    """import-hf, then export-hf of the run (no training step between): the same config and the same logits."""
    assert main(["export-hf", str(imported), str(tmp_path / "again")]) == 0
    assert f"{imported} has no checkpoint yet; its initial weights" in capsys.readouterr().err
    ids = AutoTokenizer.from_pretrained(release)(PROMPT, return_tensors="pt").input_ids
    assert torch.equal(logits(release, ids), logits(tmp_path / "again", ids))
    config, again = (
        json.loads((d / "config.json").read_text()) for d in (release, tmp_path / "again")
    )
    assert again == config
    assert yaml.safe_load((tmp_path / "again/mhf_dist.yaml").read_text())["exported_step"] == 0


def test_eval_generate_and_calibration_read_an_imported_run_as_its_release(
    release, imported, data, tmp_path, capsys
):
    """eval (with --calibrate) and generate give the release's results on the imported run; export-hf
    --inference-temperature auto fits on the run's validation split the τ that eval fits there."""
    sequences = yaml.safe_load((imported / "config.yaml").read_text())["train"]["eval_sequences"]
    results, texts = [], []
    for model in (release, imported):
        assert (
            main(
                [
                    "eval",
                    "--model",
                    str(model),
                    "--data",
                    str(data["shards"]),
                    "--calibrate",
                    "--max-sequences",
                    str(sequences),
                    "--out",
                    str(tmp_path / "eval.json"),
                ]
            )
            == 0
        )
        results.append(json.loads((tmp_path / "eval.json").read_text())["perplexity"])
        assert (
            main(["generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "6"])
            == 0
        )
        texts.append(capsys.readouterr().out.splitlines()[-1])
    assert results[0] == results[1] and texts[0] == texts[1] and texts[0].startswith(PROMPT)

    assert (
        main(["export-hf", str(imported), str(tmp_path / "hf"), "--inference-temperature", "auto"])
        == 0
    )
    assert "validation split" in capsys.readouterr().out
    tau = json.loads((tmp_path / "hf/config.json").read_text())["inference_temperature"]
    assert tau == pytest.approx(results[0]["temperature"], rel=1e-6) and tau != 1.0


def test_import_names_a_bad_config_field_and_warns_of_unknown_keys(release, tmp_path, capsys):
    """A field of the wrong type is named as a config.json problem (not as a tokenizer that cannot load); keys that
    nothing reads (e.g. misspelt) are listed in a warning, while the older spellings transformers reads are not."""
    src = tmp_path / "src"
    shutil.copytree(release, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"head_dim": None, "num_hashs": 4}))
    assert main(["import-hf", str(src), "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert (
        f"{src / 'config.json'}: Validation error for field 'head_dim': TypeError: Field 'head_dim' expected int"
        in err
        and "correct that field" in err
        and "tokenizer" not in err
    )
    assert (
        f"warning: {src / 'config.json'} has keys that neither transformers' Qwen3 config nor mhf-dist reads, "
        "ignored: num_hashs\n" in err
    )
    assert not (tmp_path / "bad").exists()

    (src / "config.json").write_text(
        json.dumps(config | {"num_hashs": 4, "xyz": 1, "rope_theta": 1e6})
    )
    assert main(["import-hf", str(src), "--run-dir", str(tmp_path / "run")]) == 0
    assert "reads, ignored: num_hashs, xyz\n" in capsys.readouterr().err


def test_generate_hands_over_its_text_in_pieces_as_it_is_generated(release):
    """The callback sees the prompt, then the continuation piece by piece (several pieces, before generate returns),
    and the pieces make up the decoded text."""
    from mhf_dist.commands.generate import generate

    hf = AutoModelForCausalLM.from_pretrained(release, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(release)
    pieces = []
    ids = generate(hf, tokenizer, PROMPT, max_new_tokens=16, on_text=pieces.append)
    assert pieces[0] == PROMPT and len(pieces) > 2
    assert "".join(pieces[1:]) == tokenizer.decode(ids, skip_special_tokens=True)


def test_generate_refuses_an_empty_prompt_and_caps_new_tokens_at_the_models_positions(
    release, tmp_path, capsys
):
    assert main(["generate", "--model", str(release), "--prompt", ""]) == 2
    assert "--prompt '' has no tokens: give some text to continue" in capsys.readouterr().err

    prompt_tokens = len(AutoTokenizer.from_pretrained(release)(PROMPT).input_ids)
    short = tmp_path / "short"  # the release with room for 3 tokens after the prompt
    shutil.copytree(release, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(
        json.dumps(config | {"max_position_embeddings": prompt_tokens + 3})
    )
    assert (
        main(
            [
                "generate",
                "--model",
                str(short),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                "100000",
                "--json",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert (
        f"--max-new-tokens 100000 capped at 3: the prompt's {prompt_tokens} tokens and the new ones fill the "
        f"model's {prompt_tokens + 3} positions (max_position_embeddings)"
    ) in err
    (line,) = out.splitlines()  # one JSON object
    result = json.loads(line)
    assert result["new_tokens"] == 3 and result["prompt"] == PROMPT

    assert (
        main(["generate", "--model", str(short), "--prompt", PROMPT, "--max-new-tokens", "3"]) == 0
    )
    # the streamed text, as --json has it
    assert capsys.readouterr().out == PROMPT + result["completion"] + "\n"
    assert main(["generate", "--model", str(short), "--prompt", PROMPT + PROMPT]) == 2
    assert (
        "(max_position_embeddings), leaving none to generate: shorten the prompt"
        in capsys.readouterr().err
    )


def test_eval_says_its_sequence_length_and_refuses_one_past_the_models_positions(
    release, data, tmp_path, capsys
):
    args = [
        "--data",
        str(data["shards"]),
        "--max-sequences",
        "2",
        "--out",
        str(tmp_path / "eval.json"),
    ]
    assert main(["eval", "--model", str(release), *args]) == 0
    assert (
        "note: evaluating val at 64 tokens a sequence (the shards' seq_len; the model has 32768 positions): "
        "perplexity depends on the length"
    ) in capsys.readouterr().err
    assert json.loads((tmp_path / "eval.json").read_text())["perplexity"]["seq_len"] == 64

    short = tmp_path / "short"
    shutil.copytree(release, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 48}))
    assert main(["eval", "--model", str(short), *args]) == 2
    err = capsys.readouterr().err
    assert (
        f"{data['shards']} holds sequences of 64 tokens, more than the model's 48 positions "
        "(max_position_embeddings): evaluate on shards prepared with --seq-len 48 or less"
    ) in err


def test_an_exported_files_metadata_is_written_in_one_order(tmp_path):
    """safetensors orders the metadata by a hash that changes per process: the export sorts it in place, so the same
    checkpoint gives the same bytes whatever order a process wrote."""
    from safetensors.torch import load_file, save_file

    from mhf_dist.commands.export import sort_metadata

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4, dtype=torch.bfloat16)}
    written = []
    for order in (["step", "source"], ["source", "step"]):
        path = tmp_path / f"{order[0]}.safetensors"
        save_file(tensors, str(path), metadata={"step": "40", "source": "runs/é/step-00000040"})
        size = int.from_bytes(path.read_bytes()[:8], "little")
        header = json.loads(path.read_bytes()[8 : 8 + size])
        # as a process may write it
        header["__metadata__"] = {key: header["__metadata__"][key] for key in order}
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode().ljust(size)
        path.write_bytes(path.read_bytes()[:8] + raw + path.read_bytes()[8 + size :])
        sort_metadata(path)
        written.append(path.read_bytes())
    assert written[0] == written[1]
    assert b'"__metadata__":{"source":"runs/\xc3\xa9/step-00000040","step":"40"}' in written[0]
    loaded = load_file(str(tmp_path / "step.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())

"""Hugging Face export and import (docs/spec.md §9), generation and evaluation under P_inf (docs/spec.md §5)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.runs import metrics, run_cli, trained_model
from mhf_dist.commands.evaluate import perplexity, split_last_word
from mhf_dist.config import RunConfig
from mhf_dist.data.reader import ShardReader
from mhf_dist.hf.exporter import build_hf_model
from mhf_dist.model.documents import targets_of
from mhf_dist.train.trained_weights import trained_weights
from mhf_dist.vocab.signatures import SignatureTable
from mhf_dist.vocab.token_list import tokens_fingerprint, vocabulary

# every test exports or reads the runs the `trained` fixture trains under `mhf-dist train`
pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    for name in ("mhf", "standard"):
        run_cli(["export-hf", str(trained[name]), str(out / name)])
    return {"mhf": out / "mhf", "standard": out / "standard"}


PROMPT = "And God said, Let there be light"


def test_export_logits_are_log_p_inf(trained, exported):
    hf = AutoModelForCausalLM.from_pretrained(exported["mhf"], trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(exported["mhf"])
    ours, our_tok, table = trained_model(trained["mhf"])
    assert vocabulary(tokenizer) == vocabulary(our_tok)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = hf(ids).logits
        expected = ours.log_p_inf(ids)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(ids.shape), rtol=0, atol=1e-5)
    assert torch.isneginf(logits[..., ~table.registered_mask()]).all()

    files = {p.name for p in exported["mhf"].iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_multihashformer.py",
        "configuration_multihashformer.py",
        "generation_config.json",
        "tokenizer.json",
    } <= files
    weights = load_file(str(exported["mhf"] / "model.safetensors"))
    assert torch.equal(weights["model.hash_map"], table.codes.long())
    assert weights["model.embed_tokens.weight"].shape == (4 * 256, 64)
    assert {
        "model.combiner.scorer.0.weight",
        "model.combiner.output_proj.0.weight",
        "hash_head.cascade_mixer.2.2.bias",
        "model.layers.1.self_attn.q_norm.weight",
        "model.norm.weight",
    } <= set(weights)
    config = json.loads((exported["mhf"] / "config.json").read_text())
    assert (
        config["num_hashes"],
        config["num_buckets"],
        config["bottle_neck_dim"],
        config["num_lsh"],
    ) == (4, 256, 64, 0)
    # τ = 1 (the default) leaves log P_inf exactly as it was computed before there was a τ
    assert config["inference_temperature"] == 1.0
    with torch.no_grad():
        assert torch.equal(logits, unscaled_scores(hf, ids).log_softmax(-1))


def unscaled_scores(hf, ids: torch.Tensor) -> torch.Tensor:
    """``score(w)`` as the exported model computes it (``-inf`` for unregistered tokens), before any τ."""
    hidden, hash_map = hf.model(ids).last_hidden_state, hf.model.hash_map
    score = sum(
        logp[..., hash_map[:, i]] for i, logp in enumerate(hf.hash_head(hidden, hf.lm_head.weight))
    )
    return score.masked_fill(~(hash_map != 0).any(dim=1), float("-inf"))


def test_inference_temperature_survives_export_import_export(trained, exported, tmp_path):
    """``--inference-temperature auto`` takes the run's fitted val_temperature; the logits are log_softmax(τ · log
    P_inf); import keeps τ in the run config, so the next export applies it again. Standard refuses τ ≠ 1."""
    last = metrics(trained["mhf"])[-1]
    tau = last["val_temperature"]
    assert last["val_p_inf_nll_calibrated"] < last["val_p_inf_nll"] and tau != 1.0
    out = run_cli(
        ["export-hf", str(trained["mhf"]), str(tmp_path / "hf"), "--inference-temperature", "auto"]
    )
    assert f"val_temperature of step {last['step']}" in out
    assert json.loads((tmp_path / "hf/config.json").read_text())["inference_temperature"] == tau
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    raw = AutoModelForCausalLM.from_pretrained(exported["mhf"], trust_remote_code=True)
    ids = AutoTokenizer.from_pretrained(tmp_path / "hf")(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = hf(ids).logits
        assert torch.equal(logits, (tau * unscaled_scores(hf, ids)).log_softmax(-1))
        torch.testing.assert_close(
            logits, (tau * raw(ids).logits).log_softmax(-1), rtol=0, atol=1e-5
        )
    # the ranking does not depend on τ
    assert torch.equal(logits.argmax(-1), raw(ids).logits.argmax(-1))

    run_cli(["import-hf", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "imported")])
    assert yaml.safe_load((tmp_path / "imported/config.yaml").read_text())["inference"] == {
        "temperature": tau
    }
    run_cli(
        [
            "train",
            "--config",
            str(tmp_path / "imported/config.yaml"),
            "--run-dir",
            str(tmp_path / "imported"),
            "--set",
            "train.max_steps=1",
        ]
    )
    run_cli(["export-hf", str(tmp_path / "imported"), str(tmp_path / "again")])
    assert json.loads((tmp_path / "again/config.json").read_text())["inference_temperature"] == tau
    assert yaml.safe_load((tmp_path / "again/mhf_dist.yaml").read_text())["inference"] == {
        "temperature": tau
    }

    out = run_cli(
        [
            "export-hf",
            str(trained["standard"]),
            str(tmp_path / "std"),
            "--inference-temperature",
            "0.5",
        ],
        expect_rc=2,
    )
    assert (
        "plain Qwen3ForCausalLM" in out
        and "sample at temperature 2" in out
        and not (tmp_path / "std").exists()
    )


def test_generate_with_and_without_cache_and_only_registered_tokens(exported):
    hf = AutoModelForCausalLM.from_pretrained(exported["mhf"], trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(exported["mhf"])
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    cached = hf.generate(ids, use_cache=True, **greedy)
    uncached = hf.generate(ids, use_cache=False, **greedy)
    assert torch.equal(cached, uncached)
    assert torch.equal(hf.generate(ids, num_beams=3, **greedy)[:, : ids.shape[1]], ids)

    registered = (hf.model.hash_map != 0).any(dim=1)
    torch.manual_seed(0)
    for kw in (
        {"temperature": 5.0},
        {"temperature": 3.0, "top_k": 40},
        {"temperature": 3.0, "top_p": 0.95},
    ):
        out = hf.generate(
            ids.repeat(4, 1),
            do_sample=True,
            max_new_tokens=16,
            pad_token_id=tokenizer.pad_token_id,
            **kw,
        )
        assert registered[out[:, ids.shape[1] :]].all(), kw

    bf16 = AutoModelForCausalLM.from_pretrained(
        exported["mhf"], trust_remote_code=True, dtype=torch.bfloat16
    )
    assert (
        bf16.model.embed_tokens.weight.dtype == torch.bfloat16
        and bf16.model.hash_map.dtype == torch.long
    )
    with torch.no_grad():
        logits16, logits32 = bf16(ids).logits, hf(ids).logits
    assert torch.isfinite(logits16[..., registered]).all()
    torch.testing.assert_close(logits16.exp().sum(-1), torch.ones(ids.shape), rtol=0, atol=1e-4)
    assert (logits16.argmax(-1) == logits32.argmax(-1)).float().mean() > 0.5


def test_compiled_decoding_generates_the_eager_tokens(exported):
    """``generate --compile``: the static cache and the compiled decode step (fullgraph, so the hash head is
    captured whole, as CUDA graphs need) give the eager greedy tokens."""
    from mhf_dist.commands.generate import generate

    hf = AutoModelForCausalLM.from_pretrained(exported["mhf"], trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported["mhf"])
    eager = generate(hf, tokenizer, PROMPT, max_new_tokens=8)
    assert torch.equal(generate(hf, tokenizer, PROMPT, max_new_tokens=8, compile=True), eager)


def test_standard_exports_as_plain_qwen3(trained, exported):
    config = json.loads((exported["standard"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and "auto_map" not in config
    assert not list(exported["standard"].glob("*.py"))
    hf = AutoModelForCausalLM.from_pretrained(exported["standard"])  # no remote code
    ours, tokenizer, _ = trained_model(trained["standard"])
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(
            hf(ids).logits.log_softmax(-1), ours.log_p_inf(ids), rtol=0, atol=1e-5
        )


def test_import_of_an_export_restores_the_run(trained, exported, data, tmp_path):
    out = run_cli(["import-hf", str(exported["mhf"]), "--run-dir", str(tmp_path / "imported")])
    assert "0 differ from a fresh docs/spec.md §1 build, 0 shared" in out
    tw = trained_weights(trained["mhf"])
    init = load_file(str(tmp_path / "imported/init/model.safetensors"))
    assert init.keys() == tw.state.keys()
    for name, tensor in tw.state.items():
        assert torch.equal(init[name], tensor), name
    original = SignatureTable.load(trained["mhf"] / "signatures")
    assert (
        SignatureTable.load(tmp_path / "imported/signatures").content_hash == original.content_hash
    )
    cfg = yaml.safe_load((tmp_path / "imported/config.yaml").read_text())
    assert cfg["model"] == tw.cfg.model_dump(mode="json")["model"]
    assert cfg["data"] == tw.cfg.model_dump(mode="json")["data"]

    # The trainer continues from the imported weights: its first step sees the same batch as the original
    # run's first step (same seed and data), at a much lower loss than that fresh start.
    run_cli(
        [
            "train",
            "--config",
            str(tmp_path / "imported/config.yaml"),
            "--run-dir",
            str(tmp_path / "imported"),
            "--set",
            "train.max_steps=1",
        ]
    )
    assert metrics(tmp_path / "imported")[0]["loss"] < metrics(trained["mhf"])[0]["loss"] - 1.0


def test_import_lists_signature_differences(exported, tmp_path):
    """A table built by another rule (here: two tokens' signatures swapped) imports as is, differences listed."""
    src = tmp_path / "theirs"
    src.mkdir()
    for f in exported["mhf"].iterdir():
        if f.name not in ("mhf_dist.yaml", "model.safetensors"):
            (src / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    del config["signature_rule"]  # the authors' config has none
    (src / "config.json").write_text(json.dumps(config))
    weights = load_file(str(exported["mhf"] / "model.safetensors"))
    hash_map = weights["model.hash_map"].clone()
    hash_map[[5, 9]] = hash_map[[9, 5]]
    # rounded-up rows
    weights["model.hash_map"] = torch.cat([hash_map, torch.zeros(7, 4, dtype=torch.long)])
    from safetensors.torch import save_file

    save_file(weights, str(src / "model.safetensors"))
    out = run_cli(["import-hf", str(src), "--run-dir", str(tmp_path / "run")])
    assert "2 differ from a fresh docs/spec.md §1 build" in out
    report = json.loads((tmp_path / "run/import-report.json").read_text())
    assert [d["id"] for d in report["differing"]] == [5, 9]
    assert torch.equal(SignatureTable.load(tmp_path / "run/signatures").codes, hash_map.int())

    config["num_lsh"] = 2
    (src / "config.json").write_text(json.dumps(config))
    assert "num_lsh=2" in run_cli(
        ["import-hf", str(src), "--run-dir", str(tmp_path / "lsh")], expect_rc=2
    )


def test_import_refuses_broken_model_directories(exported, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(exported["mhf"], src)
    good = json.loads((src / "config.json").read_text())
    cases = [
        ("{", "config.json is not valid JSON"),
        (
            json.dumps({k: v for k, v in good.items() if k != "hidden_size"}),
            "config.json lacks hidden_size",
        ),
        (json.dumps(good | {"intermediate_size": 128}), "do not fit its config.json"),
    ]
    for i, (text, message) in enumerate(cases):
        (src / "config.json").write_text(text)
        out = run_cli(["import-hf", str(src), "--run-dir", str(tmp_path / f"run{i}")], expect_rc=2)
        assert message in out and "Traceback" not in out, out
        assert not (tmp_path / f"run{i}" / "config.yaml").exists()
    assert "weights (192, 64), config (128, 64)" in out


def test_only_our_own_model_code_runs_without_trust_remote_code(exported, tmp_path):
    import shutil

    src = tmp_path / "edited"
    shutil.copytree(exported["mhf"], src)
    ran = tmp_path / "ran"
    with (src / "modeling_multihashformer.py").open("a") as f:
        f.write(f"\nopen({str(ran)!r}, 'w').close()\n")
    args = ["generate", "--model", str(src), "--prompt", PROMPT, "--max-new-tokens", "2"]
    out = run_cli(args, expect_rc=2)
    assert (
        "differ from the model code this mhf-dist exports" in out and "--trust-remote-code" in out
    )
    assert not ran.exists()
    run_cli([*args, "--trust-remote-code"])
    assert ran.exists()  # the user vouched for it
    run_cli(
        ["generate", "--model", str(exported["mhf"]), "--prompt", PROMPT, "--max-new-tokens", "2"]
    )  # ours


def test_eval_perplexity_and_last_word_under_p_inf(trained, exported, data, tmp_path):
    lambada = REPO / "tools/lm_eval/lambada_local.jsonl"
    out = run_cli(
        [
            "eval",
            "--model",
            str(exported["mhf"]),
            "--data",
            str(data["shards"]),
            "--max-sequences",
            "6",
            "--batch-size",
            "4",
            "--lambada",
            str(lambada),
            "--out",
            str(tmp_path / "eval.json"),
            "--calibration-split",
            "train",
        ]
    )
    assert "optimistic" not in out
    results = json.loads((tmp_path / "eval.json").read_text())

    ours, tokenizer, _ = trained_model(trained["mhf"])
    with ShardReader(
        data["shards"], split="val", tokenizer_fingerprint=tokens_fingerprint(vocabulary(tokenizer))
    ) as r:
        batch = r.next_batch(6)
    with torch.no_grad():
        nll = ours.evaluation(batch[:, :-1], batch[:, 1:]).p_inf_nll.item()
        logp = ours.log_p_inf(batch[:, :-1])
    ppl = results["perplexity"]
    assert ppl["tokens"] == batch[:, 1:].numel()
    assert ppl["p_inf_nll"] == pytest.approx(nll, rel=1e-5)
    top5 = logp.topk(5, dim=-1).indices
    assert ppl["top1"] == (top5[..., 0] == batch[:, 1:]).double().mean().item()
    assert ppl["top5"] == (top5 == batch[:, 1:, None]).any(-1).double().mean().item()
    # τ fitted on the training split lowers the held-out NLL; at that τ it is log_softmax(τ · log P_inf)'s NLL
    tau = ppl["temperature"]
    assert ppl["calibration"]["split"] == "train" and ppl["calibration"]["temperature"] == tau
    assert ppl["p_inf_nll_calibrated"] < ppl["p_inf_nll"] - 0.1
    expected = -(tau * logp.double()).log_softmax(-1).gather(-1, batch[:, 1:, None]).mean().item()
    assert ppl["p_inf_nll_calibrated"] == pytest.approx(expected, rel=1e-5)

    hf = AutoModelForCausalLM.from_pretrained(exported["mhf"], trust_remote_code=True)
    correct = 0
    docs = [json.loads(line)["text"] for line in lambada.read_text().splitlines()]
    for text in docs:  # the definition: the greedy continuation reproduces the last word's tokens
        context, target = split_last_word(text)
        ctx = tokenizer(context, add_special_tokens=False, return_tensors="pt").input_ids
        want = tokenizer(target, add_special_tokens=False, return_tensors="pt").input_ids[0]
        got = hf.generate(
            ctx, max_new_tokens=len(want), do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        correct += torch.equal(got[0, ctx.shape[1] :], want)
    assert results["last_word"]["documents"] == len(docs)
    assert results["last_word"]["accuracy"] == correct / len(docs)


def test_eval_reads_a_masked_models_documents_apart_as_its_run_measures_them(
    trained, exported, short_documents, tmp_path
):
    """A model trained with data.document_masking is scored as its run scores val_loss: each document of a row
    read apart and an EOS's next token not counted. Exported (our model read through the authors' layout, each
    document on a row of its own) it gives the P_inf NLL of our model with the block-diagonal mask."""
    hf = AutoModelForCausalLM.from_pretrained(exported["mhf"], trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(exported["mhf"])
    eos = tokenizer.eos_token_id
    hf.config.document_masking = True  # what export-hf writes for a masked run (below)
    masked = perplexity(hf, tokenizer, short_documents["shards"], max_sequences=5, batch_size=2)
    whole = perplexity(
        hf, tokenizer, short_documents["shards"], max_sequences=5, document_masking=False
    )

    ours, _, _ = trained_model(trained["mhf"], document_eos=eos)
    fingerprint = tokens_fingerprint(vocabulary(tokenizer))
    with ShardReader(
        short_documents["shards"], split="val", tokenizer_fingerprint=fingerprint
    ) as r:
        batch = r.next_batch(5)
    targets = targets_of(batch, eos)
    assert (targets == -1).sum() >= 5  # several documents a row
    with torch.no_grad():
        nll = ours.evaluation(batch[:, :-1], targets).p_inf_nll.item()
    assert masked["document_masking"] and not whole["document_masking"]
    assert masked["tokens"] == (targets >= 0).sum().item() < whole["tokens"] == batch[:, 1:].numel()
    assert masked["p_inf_nll"] == pytest.approx(nll, rel=1e-5)
    assert abs(masked["p_inf_nll"] - whole["p_inf_nll"]) > 1e-3

    # export-hf of a masked run says so in config.json (an unmasked one's is as before), and import-hf reads it
    tw = trained_weights(trained["mhf"])
    cfg = RunConfig.model_validate(
        tw.cfg.model_dump(mode="json")
        | {"data": {**tw.cfg.data.model_dump(mode="json"), "document_masking": True}}
    )
    table = SignatureTable.load(trained["mhf"] / "signatures")
    assert build_hf_model(cfg, tw.state, tokenizer, table).config.document_masking is True
    assert "document_masking" not in json.loads((exported["mhf"] / "config.json").read_text())
    copy = tmp_path / "masked"
    shutil.copytree(exported["mhf"], copy)
    config = json.loads((copy / "config.json").read_text()) | {"document_masking": True}
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "mhf_dist.yaml").unlink()
    out = run_cli(["import-hf", str(copy), "--run-dir", str(tmp_path / "imported")])
    assert "document_masking" not in out  # no unknown-key warning
    imported = yaml.safe_load((tmp_path / "imported/config.yaml").read_text())
    assert imported["data"]["document_masking"] is True


def test_generate_cli_from_a_run_directory(trained):
    out = run_cli(
        [
            "generate",
            "--model",
            str(trained["mhf"]),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "5",
            "--temperature",
            "0.8",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
        ]
    )
    assert PROMPT in out


def test_lm_eval_harness_on_the_local_task(exported, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "hf",
            "--model_args",
            f"pretrained={exported['mhf']},trust_remote_code=True",
            "--include_path",
            str(REPO / "tools/lm_eval"),
            "--tasks",
            "mhf_lambada_local",
            "--device",
            "cpu",
            "--batch_size",
            "8",
            "--output_path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"HF_DATASETS_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.rglob("results_*.json")
    metrics_ = json.loads(result.read_text())["results"]["mhf_lambada_local"]
    assert 0.0 <= metrics_["acc,none"] <= 1.0
    assert torch.isfinite(torch.tensor(metrics_["perplexity,none"]))

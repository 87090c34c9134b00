"""Downstream tasks inside a run (``train.eval_tasks``): the scores a run logs at a step are lm-eval's Hugging Face
model's on ``export-hf`` of that step's checkpoint, in every layout; a task that cannot be scored stops the run
before its first step."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from helpers.runs import metrics, run_cli, train_args
from mhf_dist.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHOICE_YAML = """\
task: mhf_choice_local
custom_dataset: !function mhf_choice_local.load
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""

CHOICE_LOADER = """\
import json
from pathlib import Path

import datasets


def load(**_kwargs):
    lines = Path(__file__).with_name("choice_local.jsonl").read_text().splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(x) for x in lines])})


def load_passages(**_kwargs):
    lines = Path(__file__).with_name("passages_local.jsonl").read_text().splitlines()
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([json.loads(x) for x in lines])})
"""

ROLLING_YAML = """\
task: mhf_rolling_local
custom_dataset: !function mhf_choice_local.load_passages
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""

# a perplexity task's passages: the longest spans several windows of the runs' 64 tokens
PASSAGES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of "
    "God moved upon the face of the waters. And God said, Let there be light: and there was light. And God saw "
    "the light, that it was good: and God divided the light from the darkness. And God called the light Day, "
    "and the darkness he called Night. And the evening and the morning were the first day.",
    "The LORD is my shepherd; I shall not want.",
]

QUESTIONS = [
    ("In the beginning God created the heaven and the", ["earth", "sea", "night", "bread"], 0),
    ("And God said, Let there be", ["water", "light", "kings", "gold"], 1),
    ("The LORD is my shepherd; I shall not", ["eat", "run", "want", "sing"], 2),
    ("Blessed are the poor in", ["land", "house", "gold", "spirit"], 3),
    ("Our Father which art in", ["heaven", "Egypt", "water", "prison"], 0),
]

TASKS = ["mhf_lambada_local", "mhf_choice_local", "mhf_rolling_local"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A four-choice task over a local JSONL file (lm-eval's multiple_choice), beside its loader."""
    out = tmp_path_factory.mktemp("tasks")
    (out / "mhf_choice_local.yaml").write_text(CHOICE_YAML)
    (out / "mhf_choice_local.py").write_text(CHOICE_LOADER)
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    (out / "choice_local.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "mhf_rolling_local.yaml").write_text(ROLLING_YAML)
    passages = "".join(json.dumps({"text": text}) + "\n" for text in PASSAGES)
    (out / "passages_local.jsonl").write_text(passages)
    return out


def task_settings(task_dir: Path) -> list[str]:
    return [
        f"train.eval_tasks=[{','.join(TASKS)}]",
        f"train.eval_tasks_path=[{REPO / 'tools/lm_eval'},{task_dir}]",
        "train.eval_tasks_samples=true",
    ]


def lm_eval_on_export(run: Path, out: Path, task_dir: Path) -> dict:
    """lm-eval's Hugging Face model (``lm_eval --model hf``) on ``export-hf`` of the run's newest checkpoint, at
    the run's sequence length: ``{task: (results, samples)}``."""
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    run_cli(["export-hf", str(run), str(out)])
    found = simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,max_length=64",
        tasks=TASKS,
        task_manager=TaskManager(
            include_path=[str(REPO / "tools/lm_eval"), str(task_dir)], include_defaults=False
        ),
        device="cpu",
        batch_size=8,
        bootstrap_iters=0,
        log_samples=True,
    )
    return {t: (found["results"][t], found["samples"][t]) for t in TASKS}


def responses(samples: list[dict]) -> dict[int, list[tuple[float, bool | None]]]:
    """Each document's ``(log-likelihood, greedy)`` per request, from lm-eval's logged samples (a rolling
    log-likelihood has no greedy flag: None)."""
    from lm_eval.utils import handle_non_serializable

    def response(r: list) -> tuple[float, bool | None]:
        if isinstance(
            r[0], (int, float, str)
        ):  # loglikelihood_rolling: the passage's log-likelihood alone
            return float(r[0]), None
        return float(r[0][0]), r[0][1] in (True, "True")

    found = {}
    for s in json.loads(json.dumps(samples, default=handle_non_serializable)):
        found[s["doc_id"]] = [response(r) for r in s["resps"]]
    return found


def assert_matches_lm_eval(run: Path, step: int, tmp_path: Path, task_dir: Path) -> None:
    """The run's scores at its last step ``step`` equal lm-eval's on the export of that step's checkpoint:
    accuracies exactly, each request's log-likelihood within 1e-4."""
    record = next(r for r in metrics(run) if r["step"] == step and "eval_tasks_s" in r)
    theirs = lm_eval_on_export(run, tmp_path / "hf", task_dir)
    assert_same_requests(
        scored_requests(run, step), {t: responses(samples) for t, (_, samples) in theirs.items()}
    )
    for task, (results, _) in theirs.items():
        if task == "mhf_rolling_local":
            for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
                want = results[f"{metric},none"]
                assert record[f"eval/{task}/{metric}"] == pytest.approx(want, rel=1e-4), metric
        else:
            assert record[f"eval/{task}/acc"] == results["acc,none"], task
    assert math.isfinite(record["eval/mhf_lambada_local/perplexity"])


def assert_same_requests(ours: dict[str, dict], expected: dict[str, dict]) -> None:
    """Each task's requests (``responses``) alike: log-likelihoods within 1e-4, greedy flags equal."""
    for task, documents in expected.items():
        assert ours[task].keys() == documents.keys()
        for doc, requests in documents.items():
            for (ll, greedy), (our_ll, our_greedy) in zip(requests, ours[task][doc], strict=True):
                assert abs(ll - our_ll) <= 1e-4, (task, doc, ll, our_ll)
                assert greedy == our_greedy, (task, doc)


def scored_requests(run: Path, step: int) -> dict[str, dict]:
    """The run's per-request ``responses`` of each task at ``step``."""
    found = {}
    for task in TASKS:
        lines = (run / "eval" / str(step) / f"{task}.jsonl").read_text().splitlines()
        found[task] = responses([json.loads(x) for x in lines])
    return found


@pytest.fixture(scope="module")
def single(tmp_path_factory, data, task_dir):
    """One process, scored at step 1 (the interval) and 2 (the last)."""
    run = tmp_path_factory.mktemp("single") / "run"
    args = task_settings(task_dir) + ["train.eval_tasks_interval=1"]
    run_cli(train_args(run, data, 1, *args, steps=2))
    return run


@pytest.mark.multirank
def test_in_run_scores_are_lm_eval_on_the_export_one_process(single, tmp_path, task_dir):
    records = metrics(single)
    scored = [r["step"] for r in records if "eval_tasks_s" in r]
    assert scored == [1, 2]
    for r in records:
        if r["step"] in scored:
            assert 0 <= r["eval/mhf_choice_local/acc"] <= 1
            assert "eval/mhf_choice_local/acc_norm" in r
    assert_matches_lm_eval(single, 2, tmp_path, task_dir)


LAYOUTS = {  # name: (ranks, overrides)
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
}


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_run_scores_of_every_layout_are_those_of_one_process(
    single, tmp_path, data, task_dir, layout
):
    # the layouts train the one-process weights (fp32, to rounding), whose scores are lm-eval's on the export
    nproc, overrides = LAYOUTS[layout]
    run = tmp_path / "run"
    run_cli(train_args(run, data, nproc, *overrides, *task_settings(task_dir), steps=2))
    assert_same_requests(scored_requests(run, 2), scored_requests(single, 2))
    record = next(r for r in metrics(run) if r["step"] == 2 and "eval_tasks_s" in r)
    reference = next(r for r in metrics(single) if r["step"] == 2 and "eval_tasks_s" in r)
    assert record["eval/mhf_choice_local/acc"] == reference["eval/mhf_choice_local/acc"]


@pytest.mark.multirank
def test_a_standard_run_scores_the_softmax_lm_eval_scores_on_its_export(tmp_path, data, task_dir):
    run = tmp_path / "run"
    run_cli(train_args(run, data, 1, *task_settings(task_dir), preset="tiny-standard", steps=2))
    assert_matches_lm_eval(run, 2, tmp_path, task_dir)


@pytest.mark.multirank
def test_a_task_that_does_not_load_stops_the_run_before_its_first_step(tmp_path, data, task_dir):
    run = tmp_path / "run"
    bad = ["train.eval_tasks=[no_such_task]", f"train.eval_tasks_path=[{task_dir}]"]
    out = run_cli(train_args(run, data, 1, *bad, steps=2), expect_rc=2)
    assert "train.eval_tasks" in out and "no_such_task" in out
    assert not (run / "metrics.jsonl").exists() or not metrics(run)
    broken = ["train.eval_tasks=[mhf_choice_local]", f"train.eval_tasks_path=[{tmp_path / 'none'}]"]
    out = run_cli(train_args(tmp_path / "run2", data, 1, *broken, steps=2), expect_rc=2)
    assert "train.eval_tasks_path" in out and not (tmp_path / "run2" / "metrics.jsonl").exists()


def test_task_settings_are_checked(tmp_path):
    from mhf_dist.config import ConfigError

    with pytest.raises(ConfigError, match="eval_tasks_path"):
        load_config("tiny-h4b16k", overrides=[f"train.eval_tasks_path=[{tmp_path / 'missing'}]"])
    with pytest.raises(ConfigError, match="eval_tasks"):
        load_config("tiny-h4b16k", overrides=["train.eval_tasks=['  ']"])
    with pytest.raises(ConfigError, match="eval_tasks_interval"):
        load_config("tiny-h4b16k", overrides=["train.eval_tasks_interval=0"])
    cfg = load_config("tiny-h4b16k", overrides=["train.eval_tasks=[mhf_lambada_local]"])
    assert cfg.train.eval_tasks == ["mhf_lambada_local"] and cfg.train.eval_tasks_interval is None


def test_a_task_that_generates_text_is_refused(tmp_path, task_dir):
    from mhf_dist.config import ConfigError
    from mhf_dist.train.downstream import load_tasks

    for f in task_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    generating = CHOICE_YAML.replace("mhf_choice_local\n", "mhf_generate_local\n", 1)
    generating = generating.replace("output_type: multiple_choice", "output_type: generate_until")
    (tmp_path / "mhf_generate_local.yaml").write_text(
        generating.replace("doc_to_choice: choices\n", "")
    )
    with pytest.raises(ConfigError, match="generate_until"):
        load_tasks(["mhf_generate_local"], [str(tmp_path)])
    assert list(load_tasks(["mhf_choice_local"], [str(tmp_path)])["tasks"]) == ["mhf_choice_local"]


def test_the_console_line_of_a_scored_step_shows_the_scores():
    from mhf_dist.train.console import step_line

    record = {
        "loss": 2.5,
        "eval/mhf_choice_local/acc": 0.4,
        "eval/mhf_lambada_local/perplexity": 812.25,
    }
    line = step_line(3, 3, record, None)
    assert "mhf_choice_local acc 0.4" in line and "mhf_lambada_local perplexity 812.2" in line
    assert "eval" not in step_line(2, 3, {"loss": 2.5}, None)


def test_local_tasks_load_without_indexing_lm_evals_own(task_dir, monkeypatch):
    import lm_eval.tasks

    from mhf_dist.train.downstream import load_tasks

    made = []

    class Recorded(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_defaults=True, **kwargs):
            made.append(include_defaults)
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recorded)
    assert list(load_tasks(["mhf_choice_local"], [str(task_dir)])["tasks"]) == ["mhf_choice_local"]
    assert made == [False]  # the local index held it
    with pytest.raises(ConfigError, match="no_such_task"):
        load_tasks(["no_such_task"], [str(task_dir)])
    assert made == [False, False, True]  # not local: lm-eval's own tasks indexed too

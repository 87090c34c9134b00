"""Loader of the ``mhf_lambada_local`` lm-eval task: the JSONL file beside this one, wherever the repo lives."""

import json
from pathlib import Path

import datasets


def load(**_kwargs) -> datasets.DatasetDict:
    lines = (Path(__file__).with_name("lambada_local.jsonl")).read_text().splitlines()
    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_list([json.loads(line) for line in lines if line])}
    )

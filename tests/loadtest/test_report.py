from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest import report
from loadtest.runner import PhaseResult, RequestResult, RunConfig, request_body
from loadtest.seed import summarize_dataset
from loadtest.stats import percentile, summarize


def test_percentiles_interpolate_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    s = summarize([3.0, 1.0, 2.0])
    assert (s.count, s.mean, s.median) == (3, 2.0, 2.0)
    assert math.isnan(summarize([]).mean)


def test_accept_length_is_the_unweighted_per_request_mean() -> None:
    # A short request with tau 2 and a long one with tau 6: the seed's mean is 4, not the
    # token-weighted 5.6.
    phase = PhaseResult(
        results=[
            RequestResult(
                ok=True,
                e2e_s=1.0,
                ttft_s=0.1,
                completion_tokens=20,
                accept_length=2.0,
                accept_source="exact",
            ),
            RequestResult(
                ok=True,
                e2e_s=2.0,
                ttft_s=0.2,
                completion_tokens=180,
                accept_length=6.0,
                accept_source="exact",
            ),
            RequestResult(ok=False, e2e_s=0.5, error="HTTP 503"),
        ],
        wall_s=4.0,
    )
    r = summarize_dataset("gsm8k", 32, phase)
    assert r.accept_length == 4.0
    assert r.output_tok_s == 50.0  # 200 tokens / 4 s
    assert (r.requests, r.failed) == (3, 1)
    assert r.ttft_ms is not None
    assert r.ttft_ms.mean == pytest.approx(150.0)


def test_seed_table_shows_card_and_ratio_and_missing_rows(tmp_path: Path) -> None:
    rows = [
        report.DatasetReport(
            "gsm8k", 32, requests=10, accept_length=5.2, accept_source="exact", output_tok_s=2015.0
        ),
        report.DatasetReport("mbpp", 32, missing="pass --mbpp-path"),
    ]
    table = report.seed_table(rows)
    gsm8k = next(line for line in table.splitlines() if line.startswith("gsm8k"))
    assert "5.20" in gsm8k and "5.3" in gsm8k and "0.981" in gsm8k and "1.000" in gsm8k
    assert "missing" in table and "pass --mbpp-path" in table
    assert "unweighted mean" in table
    report.write_json(tmp_path / "seed.json", rows, {"concurrency": 32})
    data = json.loads((tmp_path / "seed.json").read_text())
    assert data["datasets"][0]["card_accept_length"] == 5.3
    assert data["datasets"][1]["missing"] == "pass --mbpp-path"


def test_request_body_asks_for_what_the_table_needs() -> None:
    plain = request_body(RunConfig(base_url="x"), "hi")
    assert plain["return_meta_info"] is True
    assert plain["chat_template_kwargs"] == {"thinking": True}
    assert plain["max_tokens"] == 4096
    streamed = request_body(RunConfig(base_url="x", stream=True, thinking=False), "hi")
    assert streamed["stream_options"] == {"include_usage": True}
    assert "return_meta_info" not in streamed

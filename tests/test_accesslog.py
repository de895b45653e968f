from __future__ import annotations

import logging

import orjson
import pytest

from app.accesslog import ACCESS_LOGGER, AccessLog, AccessRecord, JsonFormatter, TextFormatter


def _record(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        rec = AccessRecord("req-1", "/v1/chat/completions", "m", True, worker="w:1", status=200)
        rec.ttft_ms, rec.completion_tokens = 12.5, 42
        AccessLog().emit(rec)
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    return record


def test_json_access_line_has_the_fields(caplog: pytest.LogCaptureFixture) -> None:
    doc = orjson.loads(JsonFormatter().format(_record(caplog)))
    assert doc["request_id"] == "req-1"
    assert doc["worker"] == "w:1"
    assert doc["status"] == 200
    assert doc["ttft_ms"] == 12.5
    assert doc["completion_tokens"] == 42
    assert doc["outcome"] == "ok"
    assert "prompt_tokens" not in doc  # unknown fields are left out, not null


def test_text_access_line(caplog: pytest.LogCaptureFixture) -> None:
    line = TextFormatter().format(_record(caplog))
    assert "request_id=req-1" in line and "ttft_ms=12.5" in line and "outcome=ok" in line

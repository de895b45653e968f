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


FORGED = (
    "\n2026-12-04 17:00:00,000 INFO dflash_gateway.access: request request_id=forged status=200"
)


@pytest.mark.parametrize("control", ["\n", "\r", "\x0b", "\x1c", "\x85", "\u2028"])
def test_a_field_cannot_start_a_line_of_its_own(
    caplog: pytest.LogCaptureFixture, control: str
) -> None:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        rec = AccessRecord(
            "req-1", "/v1/chat/completions", "m" + FORGED.replace("\n", control), True
        )
        rec.status, rec.error = 404, f"The model `m{FORGED}` does not exist."
        AccessLog().emit(rec)
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    line = TextFormatter().format(record)
    assert len(line.splitlines()) == 1, line
    assert "status=404" in line and "status=200" not in line.split(" model=")[0]
    assert (
        ' model="m\\x' in line or ' model="m\\u' in line
    ) and ' error="The model `m\\x0a2026' in line


def test_a_plain_value_stays_plain_and_quotes_are_escaped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        rec = AccessRecord("req-1", "/v1/chat/completions", 'a" status=200 "b', True, status=404)
        AccessLog().emit(rec)
    (record,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    line = TextFormatter().format(record)
    assert ' model="a\\" status=200 \\"b" ' in line
    assert " route=/v1/chat/completions " in line


def test_a_logged_message_and_traceback_cannot_forge_a_line() -> None:
    try:
        raise KeyError(FORGED)
    except KeyError:
        record = logging.LogRecord("x", logging.ERROR, "f", 1, "bad %s", (FORGED,), None)
        import sys

        record.exc_info = sys.exc_info()
    line = TextFormatter().format(record)
    assert all(part.startswith(" ") for part in line.split("\n")[1:])
    assert "bad \\x0a2026" in line.split("\n")[0]


def test_text_line_times_and_numbers_read_as_logging_renders_them() -> None:
    """The line's time is ``logging``'s default rendering, second after second (the formatter
    renders each second once), and numbers are written plain."""
    ours, reference = TextFormatter(), logging.Formatter("%(asctime)s")
    for created in (1_765_000_000.0, 1_765_000_000.999, 1_765_000_001.004, 1_765_000_000.5):
        record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, "", 0, "request", (), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.formatTime(record) == reference.formatTime(record)
        record.fields = {"a": -1, "b": 2.5e-07, "c": float("inf"), "d": True, "e": None}
        assert ours.format(record).endswith(" request a=-1 b=2.5e-07 c=inf d=True")

"""Logging set-up and the structured access log: one record per proxied request.

With ``log_json`` every log line is one JSON object; the access record's fields are top-level keys
(request_id, route, model, worker, status, ttft_ms, prompt_tokens, completion_tokens, outcome...).
Otherwise they are rendered as ``key=value`` pairs after the message.

Fields and messages carry what clients sent (a model name, an error that quotes it), so no
client can write a line of its own: in the text format every control character (C0, DEL, C1,
U+2028/U+2029) of a message or a field is written as an escape (a newline as ``\\x0a``), a
field value with anything but letters, digits and ``._:/@+-`` is quoted (``error="no such
model"``, with quotes and backslashes escaped), and the lines of a traceback after its first
are indented. (JSON lines are escaped by their encoder.)
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import orjson

from app.outcomes import Outcome

ACCESS_LOGGER = "dflash_gateway.access"


@dataclass(slots=True)
class AccessRecord:
    request_id: str
    route: str
    model: str
    stream: bool
    # The client's own X-Request-Id (escaped, capped): never the id above, which is the gateway's.
    client_request_id: str | None = None
    key: str | None = None  # the API key's name, never the key
    priority: str | None = None  # the request's priority class (tenants)
    worker: str | None = None  # the worker that answered (in PD mode: the decode worker)
    prefill_worker: str | None = None  # PD mode: the last attempt's prefill worker
    status: int = 0
    outcome: Outcome = Outcome.OK
    attempts: int = 0
    continuations: int = 0  # attempts that continued a broken stream (app.proxy.continuation)
    # Of prompt_tokens: the continuations' prompts (the conversation plus the answer so far).
    continuation_prompt_tokens: int = 0
    tokens_estimated: bool = False  # a continued stream's streamed tokens were estimated
    # No usage from the worker: the tokens are the gateway's estimate (app.proxy.unreported).
    usage_estimated: bool = False
    ttft_ms: float | None = None
    queue_ms: float | None = None  # time spent in the admission queue (None: never queued)
    duration_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    accept_length: float | None = None  # completion tokens per verify step (DFlash)
    chunks: int = 0
    error: str | None = None
    # An unmatched route's (``route=other``) method and path, escaped (``app.api.access``).
    method: str | None = None
    path: str | None = None


_FIELDS = tuple(f.name for f in fields(AccessRecord))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
_CONTROLS |= {0x2028: "\\u2028", 0x2029: "\\u2029"}
_PLAIN = re.compile(r"[\w.:/@+-]+")
_NUMBERS = (int, float, bool)


def escape(text: str) -> str:
    """``text`` with every control character written as an escape: never a line break."""
    return text.translate(_CONTROLS)


def _value(value: object) -> str:
    """A field's value for a ``key=value`` pair: as it is when plain, else quoted."""
    if type(value) in _NUMBERS:  # digits, ``.``, ``-``, ``+``, ``e``, inf, nan, True: plain
        return str(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and text.isprintable():
        return text
    return '"' + escape(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._second = -1  # the whole second ``_stamp`` renders
        self._stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """``logging``'s default ``2026-12-08 01:35:29,511``, its seconds rendered once a second
        (``strftime`` per line was a tenth of an access line's CPU)."""
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._stamp = time.strftime(self.default_time_format, self.converter(record.created))
            self._second = second
        return f"{self._stamp},{int(record.msecs):03d}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            line = super().format(record)
        else:  # ``Formatter.format``'s own steps for a line with no traceback, in one f-string
            record.message = escape(record.getMessage())
            record.asctime = self.formatTime(record)
            line = f"{record.asctime} {record.levelname} {record.name}: {record.message}"
        line = line.replace("\n", "\n    ")  # a traceback's lines, indented
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += " " + " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
        return line


def configure_logging(level: str, *, json: bool) -> dict[str, Any]:
    """Configure the root logger; returns a uvicorn ``log_config`` using the same formatter."""
    formatter: logging.Formatter = JsonFormatter() if json else TextFormatter()
    handler = logging.StreamHandler()
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Neither format writes a record's thread or process: each record skips looking them up
    # (``os.getpid`` is a system call per record, the access log's one a request).
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root.setLevel(level.upper())
    # One line per upstream call (health checks every few seconds) is noise, not an access log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    fmt_class = "app.accesslog.JsonFormatter" if json else "app.accesslog.TextFormatter"
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"()": fmt_class}},
        "handlers": {
            "default": {"class": "logging.StreamHandler", "formatter": "default"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
        },
    }


class AccessLog:
    """The access log; ``sink`` also gets every record (the usage log, ``app.tenants.usage``).
    A record is not changed once emitted."""

    def __init__(self, sink: Callable[[AccessRecord], None] | None = None) -> None:
        self._log = logging.getLogger(ACCESS_LOGGER)
        self.sink = sink

    def emit(self, record: AccessRecord) -> None:
        log = self._log
        if log.isEnabledFor(logging.INFO):
            # The record's fields read straight off its slots: ``dataclasses.asdict`` deep-copies
            # each value (all scalars here) and cost a third of a line's CPU.
            values = {k: v for k in _FIELDS if (v := getattr(record, k)) is not None}
            log.info("request", extra={"fields": values})
        if self.sink is not None:
            self.sink(record)

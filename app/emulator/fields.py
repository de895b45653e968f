"""The request fields chat and text completions share, validated the way SGLang answers (400).

Sampling (``n``, ``max_tokens``, ``stop``, ``temperature``, ``seed``), request ids (``rid``, a
string or a batch's list), scheduling ``priority``, ``stream_options``, the prefill/decode
bootstrap fields, and the output constraints (``response_format`` json_schema/json_object, the
``json_schema``, ``regex`` and ``ebnf`` fields; ``structural_tag`` is refused). An unset
``temperature`` counts as greedy (0) for the acceptance model.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.emulator.genrequest import MAX_CHOICES, UNNAMED_MODEL, RequestError

_MAX_TOP_LOGPROBS = 64  # beyond this the emulator lists only 64 alternatives


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def logprob_count(value: Any) -> int:
    """A ``top_logprobs`` (or text completions' ``logprobs``) count, capped."""
    return max(0, min(value, _MAX_TOP_LOGPROBS)) if is_int(value) else 0


def common(body: dict[str, Any]) -> dict[str, Any]:
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError("n must be a positive integer.")
    if n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES} on this emulated worker.")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
        raise RequestError("max_tokens must be a non-negative integer.")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list):
        stops = tuple(s for s in stop if isinstance(s, str) and s)
    temperature = body.get("temperature")
    if temperature is not None and not isinstance(temperature, int | float):
        raise RequestError("temperature must be a number.")
    seed = body.get("seed")
    rid = body.get("rid")
    rids: tuple[str, ...] | None = None
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        rids, rid = tuple(rid), None
    elif rid is not None and not isinstance(rid, str):
        raise RequestError("The rid should be a string or a list of strings.")
    priority = body.get("priority")
    if priority is not None and (
        not isinstance(priority, int) or isinstance(priority, bool) or not _int64(priority)
    ):
        raise RequestError(
            "priority must be a signed 64-bit integer "
            "between -9223372036854775808 and 9223372036854775807"
        )
    options = body.get("stream_options")
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        raise RequestError("stream_options must be an object.")
    stream = bool(body.get("stream", False))
    return {
        **_bootstrap(body),
        "priority": priority,
        "model": str(body.get("model") or UNNAMED_MODEL),
        "rid": rid,
        "stream": stream,
        "include_usage": bool(stream and options.get("include_usage")),
        "continuous_usage": bool(stream and options.get("continuous_usage_stats")),
        "max_tokens": max_tokens,
        "stop": stops,
        "temperature": float(temperature or 0.0),
        "seed": seed if isinstance(seed, int) else None,
        "ignore_eos": bool(body.get("ignore_eos", False)),
        "n": n,
        "rids": rids,
        "json_schema": _json_schema(body),
        "regex": _grammar(body, "regex"),
        "ebnf": _grammar(body, "ebnf"),
    }


def _bootstrap(body: dict[str, Any]) -> dict[str, Any]:
    """``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (SGLang's ``PDRoutingFields``),
    single values; a list (SGLang's batch form) is refused."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room"))
    if host is not None and not isinstance(host, str):
        raise RequestError("bootstrap_host must be a string.")
    if port is not None and (not is_int(port) or not 0 < port < 65536):
        raise RequestError("bootstrap_port must be a port number.")
    if room is not None and (not is_int(room) or not 0 <= room < (1 << 63)):
        raise RequestError("bootstrap_room must be a non-negative 64-bit integer.")
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


def _int64(value: int) -> bool:
    return -(1 << 63) <= value < (1 << 63)


def _grammar(body: dict[str, Any], name: str) -> Any:
    """A ``regex``/``ebnf`` field: a non-empty string (what it generates is checked once the
    request is read: ``app.emulator.openai.check_grammars``)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{name} must be a non-empty string.")
    return value


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema the answer must follow (``response_format`` json_schema/json_object, or
    the ``json_schema`` field as a string); None when unconstrained. ``structural_tag``: 400."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else fmt.get("schema")
        if not isinstance(schema, dict):
            raise RequestError("schema_ is required for json_schema response format request.")
        return schema
    if kind == "json_object":
        return {"type": "object"}
    if kind is not None and kind != "text":
        raise RequestError(_GRAMMAR_MESSAGE)
    raw = body.get("json_schema")
    if isinstance(raw, str) and raw:
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise RequestError("json_schema must be a JSON schema (a JSON string).") from None
        return parsed if isinstance(parsed, dict) else {}
    return None


_GRAMMAR_MESSAGE = (
    "This emulated worker does not generate structural_tag output (json_schema, json_object, "
    "regex and ebnf are served)."
)

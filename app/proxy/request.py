"""The few request fields the gateway reads, and the body it sends upstream.

The client's JSON is parsed once (orjson) and the handful of fields the gateway needs are checked
by hand: no pydantic model per request, unknown fields pass through untouched. Upstream the
gateway sends the client's ORIGINAL bytes with the fields it must set appended before the closing
brace (``rid`` always; ``max_tokens``/``stream_options``/``return_meta_info`` when it has to). Only
when the client's body already holds one of those keys (or a model alias must be resolved) is the
body re-serialised, once per request. The per-attempt ``rid`` is then a cheap byte concatenation.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from app.config import LimitsConfig
from app.errors import InvalidRequest


class Route(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    route: Route
    body: Mapping[str, Any]  # the parsed client body (read-only by convention)
    model: str  # what the client asked for (maybe an alias)
    served_model: str  # what the workers serve
    stream: bool
    client_wants_usage: bool  # the client itself set stream_options.include_usage
    client_wants_meta_info: bool  # the client itself set return_meta_info
    choices: int  # ``n``: choices generated in parallel
    # Everything of the upstream body except the closing ``,"rid":"..."}``.
    _prefix: bytes

    def upstream_body(self, rid: str) -> bytes:
        """The body for one upstream attempt with its own ``rid`` (32 hex chars)."""
        return self._prefix + b'"rid":"' + rid.encode("ascii") + b'"}'


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_request(
    raw: bytes, route: Route, *, limits: LimitsConfig, aliases: Mapping[str, str]
) -> ParsedRequest:
    """Validate the fields the gateway depends on; raise ``InvalidRequest`` (400) otherwise."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise _fail("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _fail("request body must be a JSON object")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model: a non-empty string is required", "model")
    if route is Route.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _fail("messages: a non-empty array is required", "messages")
        if len(messages) > limits.max_messages:
            raise _fail(f"messages: at most {limits.max_messages} messages", "messages")
        _check_messages(messages)
    else:
        _check_prompt(body.get("prompt"))

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _fail("stream: must be a boolean", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _fail("stream_options: must be an object", "stream_options")
    if stream_options and not isinstance(stream_options.get("include_usage", False), bool | None):
        raise _fail("stream_options.include_usage: must be a boolean", "stream_options")
    client_wants_usage = bool(stream_options and stream_options.get("include_usage") is True)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _fail("user: must be a string", "user")

    patch: dict[str, Any] = {}
    served = aliases.get(model, model)
    if served != model:
        patch["model"] = served
    _patch_max_tokens(body, route, limits, patch)
    if stream and not client_wants_usage:
        # Forced so the gateway always sees token counts; the chunk is dropped on the way back.
        patch["stream_options"] = {**(stream_options or {}), "include_usage": True}
    client_wants_meta_info = body.get("return_meta_info") is True
    if route is Route.CHAT and not stream and not client_wants_meta_info:
        # The exact acceptance length (meta_info.spec_verify_ct); stripped from the response.
        # SGLang refuses return_meta_info on streams, and text completions have no such field.
        patch["return_meta_info"] = True
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1

    return ParsedRequest(
        route=route,
        body=body,
        model=model,
        served_model=served,
        stream=stream,
        client_wants_usage=client_wants_usage,
        client_wants_meta_info=client_wants_meta_info,
        choices=choices,
        _prefix=_prefix(raw, body, patch),
    )


ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _check_messages(messages: list[Any]) -> None:
    """Each message an object; a role, if given, a known one; content a string, an array or
    null (what an SGLang worker would refuse with a 400 anyway, refused without a round trip)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _fail("messages: every message must be an object", "messages")
        role = message.get("role", "user")
        if not isinstance(role, str) or role not in ROLES:
            allowed = ", ".join(sorted(ROLES))
            raise _fail(f"messages[{i}].role: must be one of {allowed}", f"messages.{i}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _fail(
                f"messages[{i}].content: must be a string, an array or null",
                f"messages.{i}.content",
            )


def _check_prompt(prompt: Any) -> None:
    """A non-empty string, or a non-empty array of strings, of token ids or of token-id arrays
    (OpenAI's forms; SGLang refuses anything else)."""
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_int(p) for p in prompt):
            return
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return
    raise _fail(
        "prompt: a non-empty string, or an array of strings or of token ids, is required", "prompt"
    )


def _patch_max_tokens(
    body: Mapping[str, Any], route: Route, limits: LimitsConfig, patch: dict[str, Any]
) -> None:
    fields = ("max_tokens", "max_completion_tokens") if route is Route.CHAT else ("max_tokens",)
    present = False
    for name in fields:
        value = body.get(name)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise _fail(f"{name}: must be a positive integer", name)
        present = True
        if value > limits.max_tokens_cap:
            patch[name] = limits.max_tokens_cap
    if not present and limits.default_max_tokens is not None:
        patch["max_tokens"] = min(limits.default_max_tokens, limits.max_tokens_cap)


def _prefix(raw: bytes, body: Mapping[str, Any], patch: dict[str, Any]) -> bytes:
    """Upstream body up to where ``"rid":"..."}`` goes (ends with ``{`` or ``,``)."""
    if "rid" not in body and not any(key in body for key in patch):
        # Common case: the client's bytes, untouched, with the new fields appended.
        end = raw.rstrip().rfind(b"}")
        head = raw[:end].rstrip()
        if patch:
            head += b"," + orjson.dumps(patch)[1:-1]
        return head + b","
    merged = {key: value for key, value in body.items() if key != "rid"}
    merged.update(patch)
    try:
        dumped = orjson.dumps(merged)
    except TypeError:  # orjson writes at most 254 levels of nesting (and reads 1024)
        raise _fail("request body is nested too deeply") from None
    return dumped[:-1] + (b"," if merged else b"")

"""The few request fields the gateway reads, and the body it sends upstream.

The body is never turned into Python objects as a whole: one msgspec pass reads the top level
(the allowed fields of ``app.proxy.fields``) with only the values the gateway needs decoded --
``model``, ``stream``, ``stream_options``, ``max_tokens``, ``user``, each message's role -- and
every other value kept as its raw byte span, checked for syntax but not materialised (message
contents too: the routing key hashes the leading conversation's raw spans). Element counts are
bounded before any per-element object exists, so a body of many small objects costs about its
own size, not tens of times it. A body with a field off the allow-list is read again as spans:
a denied field is a 400 naming it, any other is dropped.

What the gateway must set in the body (the served model, ``max_tokens``, ``stream_options``,
``return_meta_info``) is decided here and spliced into the client's bytes by
``app.proxy.upstream_body``; the per-attempt ``rid`` (and ``priority``) is then one byte
concatenation.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from app.errors import InvalidRequest
from app.limits.config import LimitsConfig
from app.media_policy import image_policy
from app.model_names import resolve
from app.proxy.bounds import choices, patch_max_tokens
from app.proxy.fields import (
    ABSENT,
    ROLES,
    Message,
    Schema,
    StreamOptions,
    capped,
    check_template_kwargs,
    schema_for,
)
from app.proxy.media import check_chat_media, may_hold_media
from app.proxy.metadata import check_raw_metadata
from app.proxy.surface import CHAT, COMPLETIONS, Surface
from app.proxy.upstream_body import PRIORITY_FIELDS, field_spans, upstream_head

log = logging.getLogger(__name__)


class Route(enum.Enum):
    """A worker route the gateway sends requests to."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    COUNT_TOKENS = "/v1/messages/count_tokens"  # SGLang's Anthropic token counter


@dataclass(slots=True)
class ParsedRequest:
    """A checked request (read-only by convention: built once per request, on the hot path)."""

    route: Route
    model: str  # what the client asked for (maybe an alias)
    served_model: str  # what the workers serve
    stream: bool
    client_wants_usage: bool  # the client itself set stream_options.include_usage
    client_wants_meta_info: bool  # the client itself set return_meta_info
    choices: int  # ``n``: choices generated in parallel
    user: str | None  # the ``user`` field (a routing key)
    # The leading conversation (system prompt + first user turn) as raw spans (bytes-like), for
    # the routing key.
    conversation: tuple[Any, ...]
    dropped: str | None  # the first field dropped from the body, if any
    # Everything of the upstream body except the closing ``"rid":"..."}``.
    _head: tuple[memoryview | bytes, ...]
    # The client's API (``app.proxy.surface``): how its stream, answer and errors look.
    surface: Surface
    # The most completion tokens per choice the worker may generate (the client's max_tokens,
    # capped, or the default); None when unbounded.
    max_tokens: int | None = None
    # The whole prompt as raw spans (bytes-like): the ``tools`` array, then each message's role
    # and content; a completion's ``prompt``. What cache_aware hashes (``app.routing.prefix``).
    prefix: tuple[Any, ...] = ()

    def upstream_parts(
        self, rid: str, priority: int | None = None
    ) -> tuple[memoryview | bytes, ...]:
        """The body for one upstream attempt with its own ``rid`` (32 hex chars), as the pieces
        of the client's bytes it is made of (no copy of a large body is made here); with
        SGLang's ``priority`` field when ``priority`` is given (a class value of
        ``app.tenants.config.PRIORITIES``)."""
        tail = b'"rid":"' + rid.encode("ascii") + b'"}'
        if priority is None:
            return (*self._head, tail)
        return (*self._head, PRIORITY_FIELDS[priority], tail)

    def upstream_body(self, rid: str, priority: int | None = None) -> bytes:
        """``upstream_parts`` joined."""
        return b"".join(self.upstream_parts(rid, priority))


_SURFACES: dict[Route, Surface] = {Route.CHAT: CHAT, Route.COMPLETIONS: COMPLETIONS}
_MESSAGES = msgspec.json.Decoder(list[Message])
_TOKEN_FIELDS = {
    Route.CHAT: ("max_tokens", "max_completion_tokens"),
    Route.COMPLETIONS: ("max_tokens",),
}
_CHOICE_FIELDS = {Route.CHAT: ("n",), Route.COMPLETIONS: ("n", "best_of")}
_UNKNOWN = "Object contains unknown field `"
_AT = re.compile(r" - at `\$\.(\w+)(?:\[(\d+)\])?(?:\.(\w+))?`$")
_TOKEN_IDS = re.compile(rb"\[[0-9,\s-]*\]")


def _fail(message: str, param: str | None = None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def parse_request(
    raw: bytes,
    route: Route,
    *,
    limits: LimitsConfig,
    aliases: Mapping[str, str],
    surface: Surface | None = None,
) -> ParsedRequest:
    """Validate the fields the gateway depends on; raise ``InvalidRequest`` (400) otherwise.
    ``surface``: the client's API, when the body was translated from another one (else the
    route's own OpenAI surface)."""
    schema = schema_for(route is Route.CHAT, limits.extra_fields)
    limit = limits.max_messages
    # Every message is an object (3 bytes or more with its comma), so a short body, or one with
    # fewer braces than the limit, has few enough messages; any other has them counted first,
    # before they become objects.
    if route is Route.CHAT and len(raw) > 3 * limit and raw.count(b"{") > limit:
        _count_messages(_decode(schema.spans, raw).messages, limit)
    dropped = spans = None
    try:
        body = _decode(schema.typed, raw)
    except _Unknown as exc:
        dropped = exc.name
        log.debug("request field %r (maybe others) dropped: not on the allow-list", dropped[:100])
        spans, body = _reread(raw, schema)
    except InvalidRequest:
        # Maybe a repeated key whose earlier value is bad: the last one counts (as for the
        # worker), so read again from the last values.
        spans, body = _reread(raw, schema)

    model = body.model
    if not isinstance(model, str) or not model:
        raise _fail("model: a non-empty string is required", "model")
    if body.metadata:  # absent: an empty span
        check_raw_metadata(body.metadata)
    if route is Route.CHAT:
        conversation = _check_messages(body.messages)
        messages = body.messages
        if spans is not None:
            messages = _MESSAGES.decode(spans.messages)
            conversation = _leading(messages)
        prefix = _prompt_spans(body.tools, messages)
        if may_hold_media(raw):  # maybe a media part somewhere: each one's URL must be allowed
            policy = image_policy(limits.image_url_allow, limits.image_url_cluster_suffixes)
            check_chat_media([message.content for message in body.messages], policy)
    else:
        prompt = body.prompt if spans is None else spans.prompt
        conversation = _check_prompt(prompt, limits.max_n)
        prefix = (prompt,)
    template_kwargs = getattr(body, "chat_template_kwargs", ABSENT)
    if template_kwargs:
        check_template_kwargs(template_kwargs, limits.chat_template_kwargs)
    stream = bool(body.stream)
    options = body.stream_options or None
    client_wants_usage = options is not None and options.include_usage is True

    patch: dict[str, bytes] = {}
    served = resolve(aliases, model)
    if served != model:
        patch["model"] = orjson.dumps(served)
    max_tokens = patch_max_tokens(body, _TOKEN_FIELDS[route], limits, patch)
    if stream and not client_wants_usage:
        # Forced so the gateway always sees token counts; the chunk is dropped on the way back.
        patch["stream_options"] = _usage_options(options)
    client_wants_meta_info = bytes(body.return_meta_info) == b"true"
    if route is Route.CHAT and not stream and not client_wants_meta_info:
        # The exact acceptance length (meta_info.spec_verify_ct); stripped from the response.
        # SGLang refuses return_meta_info on streams, and text completions have no such field.
        patch["return_meta_info"] = b"true"

    return ParsedRequest(
        route=route,
        model=model,
        served_model=served,
        stream=stream,
        client_wants_usage=client_wants_usage,
        client_wants_meta_info=client_wants_meta_info,
        choices=choices(
            body, ("n", "best_of") if route is Route.COMPLETIONS else ("n",), limits.max_n
        ),
        user=body.user,
        conversation=conversation,
        dropped=dropped,
        _head=upstream_head(raw, body, spans, schema, patch),
        surface=surface or _SURFACES[route],
        max_tokens=max_tokens,
        prefix=prefix,
    )


def _reread(raw: bytes, schema: Schema) -> tuple[Any, Any]:
    """The body's fields as raw spans (a denied one is a 400 naming it), and the allowed ones,
    each once, read as ``schema.typed`` reads a body. The copy of the allowed fields lives only
    while parsing: what the request keeps points into ``raw``."""
    spans = _decode(schema.spans, raw)
    for name in schema.denied:
        if getattr(spans, name):
            raise _fail(f"{name}: not accepted by this gateway", name)
    kept = field_spans(spans, schema, {})
    if kept:
        kept[0] = b"{" + kept[0][1:]
    return spans, _decode(schema.typed, b"".join(kept) + b"}" if kept else b"{}")


class _Unknown(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    """``decoder.decode(raw)``, its errors as the 400s clients see (``_Unknown`` for a field
    ``decoder`` does not know)."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.startswith(_UNKNOWN):
            raise _Unknown(message.split("`")[1]) from None
        raise _invalid(message) from None
    except msgspec.DecodeError:
        raise _fail("request body is not valid JSON") from None
    except RecursionError:
        raise _fail("request body is nested too deeply") from None


def _invalid(message: str) -> InvalidRequest:
    """The 400 for msgspec's account of a typed field that did not match."""
    found = _AT.search(message)
    if found is None:
        return _fail("request body must be a JSON object")
    name, index, sub = found.groups()
    if name == "messages":
        if index is None:
            return _fail("messages: a non-empty array is required", "messages")
        if sub == "role":
            allowed = ", ".join(sorted(ROLES))
            return _fail(
                f"messages[{index}].role: must be one of {allowed}", f"messages.{index}.role"
            )
        return _fail("messages: every message must be an object", "messages")
    if name == "stream_options" and sub == "include_usage":
        return _fail("stream_options.include_usage: must be a boolean", "stream_options")
    explain = {
        "model": "a non-empty string is required",
        "stream": "must be a boolean",
        "stream_options": "must be an object",
        "user": "must be a string",
        "max_tokens": "must be a positive integer",
        "max_completion_tokens": "must be a positive integer",
    }
    return _fail(f"{name}: {explain.get(name, 'invalid value')}", name)


def _count_messages(value: msgspec.Raw, limit: int) -> None:
    if value and memoryview(value)[0] == ord("["):
        try:
            capped(limit).decode(value)
        except msgspec.ValidationError:
            raise _fail(f"messages: at most {limit} messages", "messages") from None


def _check_messages(messages: list[Message] | msgspec.UnsetType) -> tuple[Any, ...]:
    """Each message an object; a role, if given, a known one (checked while decoding); content a
    string, an array or null (what an SGLang worker would refuse with a 400 anyway, refused
    without a round trip). Returns the leading conversation for the routing key."""
    if not messages:
        raise _fail("messages: a non-empty array is required", "messages")
    for i, message in enumerate(messages):
        content = memoryview(message.content)
        if content and content[0] not in b'"[n':
            raise _fail(
                f"messages[{i}].content: must be a string, an array or null",
                f"messages.{i}.content",
            )
    return _leading(messages)


def _leading(messages: list[Message]) -> tuple[Any, ...]:
    """Role and raw content (bytes-like) of each message up to the first user turn."""
    head: list[Any] = []
    for message in messages:
        head += (_ROLE_BYTES[message.role], message.content)
        if message.role == "user":
            break
    return tuple(head)


_ROLE_BYTES = {role: role.encode() for role in ROLES}


def _prompt_spans(tools: msgspec.Raw, messages: list[Message]) -> tuple[Any, ...]:
    """The tools array (when given), then role and raw content of every message."""
    spans: list[Any] = [tools] if tools else []
    for message in messages:
        spans += (_ROLE_BYTES[message.role], message.content)
    return tuple(spans)


def _check_prompt(value: msgspec.Raw, max_batch: int) -> tuple[memoryview | bytes, ...]:
    """A non-empty string, or a non-empty array of strings, of token ids or of token-id arrays
    (OpenAI's forms; SGLang refuses anything else). A batch holds at most ``max_batch`` prompts.
    Returns the routing key's stand-in for the shared prefix: the first 2 KiB of a string."""
    view = memoryview(value)
    if len(view) > 2 and view[0] == ord('"'):
        return (view[:2048],)
    if view and view[0] == ord("["):
        if _is_token_ids(view):
            return ()
        try:
            batch = capped(max_batch).decode(value)
        except msgspec.ValidationError:
            message = f"prompt: at most {max_batch} prompts in one request"
            raise _fail(message, "prompt") from None
        items = [memoryview(item) for item in msgspec.structs.astuple(batch) if item]
        if items and all(item[0] == ord('"') for item in items):
            return ()
        if items and all(_is_token_ids(item) for item in items):
            return ()
    raise _fail(
        "prompt: a non-empty string, or an array of strings or of token ids, is required", "prompt"
    )


def _is_token_ids(view: memoryview) -> bool:
    """A (syntactically valid) JSON array of at least one integer."""
    return (
        view[0] == ord("[")
        and _TOKEN_IDS.fullmatch(view) is not None
        and bytes(view[-8:]).rstrip(b"] \t\r\n")[-1:].isdigit()
    )


def _usage_options(options: StreamOptions | None) -> bytes:
    """The client's stream options (the ones SGLang knows) with ``include_usage`` on."""
    if options is None or not options.continuous_usage_stats:
        return b'{"include_usage":true}'
    stats = bytes(options.continuous_usage_stats)
    return b'{"include_usage":true,"continuous_usage_stats":' + stats + b"}"

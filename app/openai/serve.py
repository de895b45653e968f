"""``POST /v1/chat/completions`` and ``POST /v1/completions``: the surface registry's OpenAI rows
(``app.surfaces``). The key is in ``Authorization: Bearer``, every error is in OpenAI's shape, and
the body is parsed as it is (``app.proxy.request``: only the fields the gateway reads are
decoded) and run by the proxy with ``CHAT`` or ``COMPLETIONS`` as its surface: the worker's
events and answers relayed byte for byte."""

from __future__ import annotations

from pydantic import BaseModel

from app.door.entry import Operation, ParsingEntry, bearer
from app.gateway import Gateway
from app.openai.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    completion_responses,
    request_body,
)
from app.proxy.request import ParsedRequest, Route, parse_request
from app.proxy.surface import CHAT, COMPLETIONS, Surface
from app.routing.routing_key import SESSION_HEADER
from app.tenants.headers import openai_headers
from app.tenants.tenant import PRIORITY_HEADER

READ = frozenset(
    {
        b"authorization",
        b"content-length",
        b"content-type",
        b"content-encoding",
        SESSION_HEADER.encode("ascii"),
        PRIORITY_HEADER.lower().encode("ascii"),
    }
)


def _entry(route: Route, surface: Surface, name: str, body: type[BaseModel]) -> ParsingEntry:
    def parse(gw: Gateway, raw: bytes) -> ParsedRequest:
        limits, aliases = gw.settings.limits, gw.settings.model_aliases
        return parse_request(raw, route, limits=limits, aliases=aliases, surface=surface)

    operation = Operation(name, request_body(body), completion_responses(), (body,))
    return ParsingEntry(
        route.value, READ, bearer, openai_headers, operation, parse=parse, surface=surface
    )


# The OpenAI surfaces, by route: ``app.surfaces`` lists them.
ENTRIES = {
    Route.CHAT: _entry(Route.CHAT, CHAT, "chat_completions", ChatCompletionRequest),
    Route.COMPLETIONS: _entry(Route.COMPLETIONS, COMPLETIONS, "completions", CompletionRequest),
}

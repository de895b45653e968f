"""The surface registry: every API the gateway serves, one line per API, one ``Entry`` per route.

``SURFACES`` is the one table of the gateway's API POST routes. Everything that depends on which
APIs exist derives from it: the dispatch ahead of FastAPI (``app.api.asgi.GatewayApp``: one dict
lookup per request, ``BY_PATH``, then the door's one list of checks, ``app.door``), FastAPI's
declaration of the routes and ``/openapi.json`` (``app.api.surfaces``), the access log's and
``requests_total``'s ``route`` labels (``ROUTES``, a bounded set: the paths), the routes whose
requests are billed in the usage log, and the shape of the errors the server's protocol answers
itself (``shape_of``, handed to ``app.server.guard``).

A surface is a package (``app.openai``, ``app.anthropic``, ``app.responses``) that provides, per
POST route, an ``app.door.entry.Entry``:

- ``route``: the path, also its ``route`` label in metrics and the access log;
- ``read``: the request headers its door reads (lower-case bytes; a repeated one is a 400);
- ``credential``: where the API key is (``bearer``: ``Authorization``; Anthropic's ``api_key``
  also reads ``x-api-key``);
- ``parse``: the body (bytes) to a ``ParsedRequest``: checked, translated to the worker's chat
  or completions body when the API is another one, then ``app.proxy.request.parse_request(...,
  surface=...)``; every refusal an ``InvalidRequest`` (400) naming the field;
- ``surface``: an ``app.proxy.surface.Surface`` -- ``shape`` (its error bodies, error events and
  keep-alive), ``observer(request, expose=)`` (the stream's translator, fed each upstream read;
  its cost is per chunk, on the hot path), ``answer(body, request)`` (a non-streamed answer; a
  translated surface derives from ``TranslatedSurface`` and writes ``whole(doc, request)``);
- ``limit_headers``: the names of its rate-limit headers (``app.tenants.headers``);
- ``operation``: its ``/openapi.json`` declaration (``app.door.entry.Operation``).

The package exports them as ``ENTRIES`` (a mapping, any key); adding the surface is then one line
here: ``*package.ENTRIES.values(),``. Paths must differ (checked at import). Every entry comes
through the same door (``app.door.entrance``): a surface adds no check of its own.

This registry sits above the surface packages and the door (which know nothing of which
surfaces exist): ``app.main`` hands it to the door and to FastAPI, ``app.server.run`` hands
``shape_of`` to the server's protocol.
"""

from __future__ import annotations

from types import MappingProxyType

from app.anthropic import serve as messages
from app.door.entry import Entry
from app.openai import serve as openai
from app.proxy.surface import OPENAI, ErrorShape
from app.responses import serve as responses

SURFACES: tuple[Entry, ...] = (
    *openai.ENTRIES.values(),  # POST /v1/chat/completions, /v1/completions
    *messages.ENTRIES.values(),  # POST /v1/messages, /v1/messages/count_tokens
    *responses.ENTRIES.values(),  # POST /v1/responses
)

BY_PATH = MappingProxyType({entry.route: entry for entry in SURFACES})
if len(BY_PATH) != len(SURFACES):
    raise RuntimeError("two surfaces declare the same path")
# The API POST routes: the bounded ``route`` label values of the requests they answer.
ROUTES: tuple[str, ...] = tuple(BY_PATH)
_SHAPES = {entry.route.encode("ascii"): entry.shape for entry in SURFACES}


def shape_of(target: bytes) -> ErrorShape:
    """The error shape of a request target's API (its path's; OpenAI's for any other)."""
    return _SHAPES.get(target.split(b"?", 1)[0], OPENAI)

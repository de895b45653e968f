"""What a surface declares for each of its POST routes: an ``Entry`` (a row of the surface
registry, ``app.surfaces``) and its ``Operation`` (how ``/openapi.json`` declares it).

An entry is one of two kinds, by how its body becomes the ``ParsedRequest`` the proxy runs:

- ``ParsingEntry``: parsed as it came (``parse``, synchronous: chat, completions, Messages);
- ``LoadingEntry``: loaded (``load``, awaited with the caller's key name): the body names state
  the gateway keeps (a stored conversation, the Responses API's ``previous_response_id``), and
  each request runs with a surface of its own.

A surface package (``app.openai``, ``app.anthropic``, ``app.responses``) builds its entries from
these and exports them as ``ENTRIES``; the door (``app.door.entrance``) serves either kind through
the same checks, so nothing here knows which surfaces exist.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, TypeAlias

from pydantic import BaseModel

from app.door.api_keys import KeyTexts, openai_key_texts
from app.gateway import Gateway
from app.proxy.request import ParsedRequest
from app.proxy.surface import ErrorShape, Surface
from app.tenants.headers import HeaderStyle


@dataclass(frozen=True, slots=True)
class Operation:
    """How ``/openapi.json`` declares a POST route: its operation id, its body (the extra
    OpenAPI of the operation: ``request_body(Model)`` for a documented model) and its answers by
    status. ``models``: the pydantic models the body refers to (added to the components)."""

    name: str
    body: Mapping[str, Any]
    responses: Mapping[int | str, Mapping[str, Any]]
    models: tuple[type[BaseModel], ...] = ()


@dataclass(frozen=True, slots=True)
class BaseEntry:
    """What every kind of entry declares: its path (also its ``route`` label in metrics and the
    access log), the headers read, where the API key is, the rate-limit headers' names and its
    OpenAPI declaration."""

    route: str
    read: frozenset[bytes]
    credential: Callable[[dict[bytes, bytes]], str | None]
    limit_headers: HeaderStyle
    operation: Operation
    _: KW_ONLY
    # The 401's messages when the key is missing or wrong (``app.door.api_keys``), in the API's
    # words for the header the key came in.
    key_texts: KeyTexts = openai_key_texts
    # Added to an unknown model's 404: where the API's clients set the model, if it is known.
    model_hint: str = ""


@dataclass(frozen=True, slots=True)
class ParsingEntry(BaseEntry):
    """An entry whose body is parsed as it came: ``parse`` makes the ``ParsedRequest``
    (translated for a translating surface; 400 naming the field), run with ``surface`` (stream
    observer, whole answer, error shape)."""

    parse: Callable[[Gateway, bytes], ParsedRequest]
    surface: Surface

    @property
    def shape(self) -> ErrorShape:
        """How the entry's refusals look."""
        return self.surface.shape


@dataclass(frozen=True, slots=True)
class LoadingEntry(BaseEntry):
    """An entry whose body is loaded: ``load`` reads the state it names (awaited with the
    caller's key name) to build the ``ParsedRequest``, which carries a surface made for that
    request; ``shape`` is how the entry's refusals look before one exists."""

    load: Callable[[Gateway, bytes, str | None], Awaitable[ParsedRequest]]
    shape: ErrorShape


# One POST route of an API surface, as the door serves it: either kind.
Entry: TypeAlias = ParsingEntry | LoadingEntry


def bearer(read: dict[bytes, bytes]) -> str | None:
    """The Authorization header (OpenAI's one place for the key)."""
    authorization = read.get(b"authorization")
    return authorization.decode("latin-1") if authorization is not None else None

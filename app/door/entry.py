"""What a surface declares for each of its POST routes: an ``Entry`` (a row of the surface
registry, ``app.surfaces``) and its ``Operation`` (how ``/openapi.json`` declares it).

A surface package (``app.openai``, ``app.anthropic``, ``app.responses``) builds its entries from
these and exports them as ``ENTRIES``; the door (``app.door.entrance``) serves any entry through
the same list of checks, so nothing here knows which surfaces exist.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from app.door.api_keys import KeyTexts, openai_key_texts
from app.gateway import Gateway
from app.proxy.request import ParsedRequest
from app.proxy.surface import Surface
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
class Entry:
    """One POST route of an API surface, as the door serves it: its path (also its ``route``
    label in metrics and the access log), the headers read, where the API key is, how the body
    becomes a ``ParsedRequest`` (translated, with ``surface`` as its surface), the surface
    (stream observer, whole answer, error shape), the rate-limit headers' names and its OpenAPI
    declaration."""

    route: str
    read: frozenset[bytes]
    credential: Callable[[dict[bytes, bytes]], str | None]
    parse: Callable[[Gateway, bytes], ParsedRequest]
    surface: Surface
    limit_headers: HeaderStyle
    operation: Operation
    # Instead of ``parse``, for a surface that reads state to build the body (a stored
    # conversation): awaited with the caller's key name.
    load: Callable[[Gateway, bytes, str | None], Awaitable[ParsedRequest]] | None = None
    # The 401's messages when the key is missing or wrong (``app.door.api_keys``), in the API's
    # words for the header the key came in.
    key_texts: KeyTexts = openai_key_texts
    # Added to an unknown model's 404: where the API's clients set the model, if it is known.
    model_hint: str = ""


def bearer(read: dict[bytes, bytes]) -> str | None:
    """The Authorization header (OpenAI's one place for the key)."""
    authorization = read.get(b"authorization")
    return authorization.decode("latin-1") if authorization is not None else None

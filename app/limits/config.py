"""``limits.*`` settings (a section of ``app.config.Settings``): what one request may ask for, and
each API key's request rate and concurrency (``app.limits.per_key``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from app.media_policy import CLUSTER_SUFFIXES, cluster_suffixes, image_policy
from app.sections import CSV, Section

# Client headers ``limits.forward_headers`` cannot name: credentials, what the gateway sets itself,
# framing, encodings (a body with a Content-Encoding is refused) and hop-by-hop headers (RFC 9110
# §7.6.1).
_NEVER_FORWARDED = frozenset(
    {
        "authorization",
        "x-api-key",
        "cookie",
        "proxy-authorization",
        "host",
        "content-length",
        "content-type",
        "content-encoding",
        "transfer-encoding",
        "accept-encoding",
        "x-request-id",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "upgrade",
        "expect",
    }
)


class LimitsConfig(Section):
    """What one request may ask for, and the per-key request limits."""

    # Largest request body accepted; a larger one is a 413.
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # A worker's non-streamed answer is read whole before it is relayed; a larger one is a 502.
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    # Request line + headers, counted as they arrive; more is answered 431 and the connection
    # closed.
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    # Open client connections per process (with --processes N, N times this in all; the metrics
    # port has its own allowance). One more is answered 503 + Retry-After at once and closed,
    # without reading its request, so idle or slow connections cannot pin unbounded sockets and
    # memory. 4096 is far above what the workers behind one process can stream (48 per worker,
    # plus the admission queue, plus idle kept-alive connections from load balancers and client
    # pools), and well inside the usual 65536 open-file limit.
    max_connections: int = Field(4096, ge=1)
    # Pipelined requests read ahead on one client connection (the one being answered included):
    # past it the connection is not read until answers end, so one write of thousands of requests
    # costs no more than this many at a time. Clients that pipeline rarely send more than a few.
    max_pipelined: int = Field(16, ge=1, le=1024)
    # Used when a request sets neither max_tokens nor max_completion_tokens (None: no cap, and
    # SGLang then generates up to the context length). Kimi-K2.5 thinks before it answers and
    # the reasoning shares this budget: Moonshot advises at least 16,000 tokens for its
    # thinking models, so a smaller default would cut answers off (finish_reason "length").
    default_max_tokens: int | None = Field(16384, ge=1)
    # Requests asking for more are clamped to this value.
    max_tokens_cap: int = Field(32768, ge=1)
    # A longer array is refused before its messages are read (a check that grows with this).
    max_messages: int = Field(2048, ge=1, le=16384)
    # At most this many choices per request (``n``, ``best_of``) and prompts per batch
    # completions request; more is a 400.
    max_n: int = Field(8, ge=1, le=256)
    # Request fields forwarded to workers besides the built-in allow-list (app/proxy/fields.py);
    # naming a denied field here allows it (e.g. lora_path on a multi-LoRA fleet).
    # Other unknown fields are dropped. Comma-separated in the environment.
    extra_fields: Annotated[tuple[str, ...], NoDecode, CSV] = ()
    # The keys chat_template_kwargs may hold: SGLang passes them to the tokenizer's
    # apply_chat_template, where chat_template would replace the served template with the
    # client's. The default is what Kimi-K2.5's template reads (thinking, its only switch) and
    # the spelling SGLang writes beside it (enable_thinking). Another key is a 400 naming it.
    # Comma-separated in the environment.
    chat_template_kwargs: Annotated[tuple[str, ...], NoDecode, CSV] = (
        "thinking",
        "enable_thinking",
    )
    # Client headers forwarded to workers besides traceparent, tracestate, baggage and
    # X-Emulator-Profile (app/proxy/headers.py); every other client header stays at the gateway.
    # Credentials, framing and hop-by-hop headers cannot be named. Comma-separated in the env.
    forward_headers: Annotated[tuple[str, ...], NoDecode, CSV] = ()
    # Media URLs (image_url, video_url, audio_url parts; Anthropic image url sources) allowed
    # besides data: and https: to public hosts (app/proxy/media.py): schemes ("http:", "file:"),
    # hosts ("images.corp", "*.corp.example"), addresses or networks ("10.1.0.0/16"), or "*"
    # for any URL. A URL outside them is a 400. Comma-separated in the environment.
    image_url_allow: Annotated[tuple[str, ...], NoDecode, CSV] = ()
    # Host name suffixes that are the cluster's own (its domain, svc and pod zones, namespaces):
    # a media URL naming a host under one is a 400, as a worker's resolver would find a
    # Service there (kubernetes.default, redis.prod) before any public name. Replaces the
    # default: keep it and add the cluster's namespaces. Comma-separated in the environment.
    image_url_cluster_suffixes: Annotated[tuple[str, ...], NoDecode, CSV] = CLUSTER_SUFFIXES
    # Per API key (by name): sustained requests/s with a burst, and requests in flight.
    key_rate_per_s: float | None = Field(None, gt=0)
    # Requests a key may send at once above its sustained rate (the size of its token bucket).
    key_burst: int = Field(20, ge=1)
    # Requests a key may have in flight at once (None: no limit); one more is 429 + Retry-After.
    key_max_concurrent: int | None = Field(None, ge=1)
    # Share the per-key limits, token quotas, stored responses and cache_aware's session homes
    # across gateway replicas (redis://host:6379/0); else each process keeps its own.
    redis_url: str | None = None

    @field_validator("image_url_allow")
    @classmethod
    def _check_image_urls(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        image_policy(entries)  # a ValueError names a bad entry
        return entries

    @field_validator("image_url_cluster_suffixes")
    @classmethod
    def _check_cluster_suffixes(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        cluster_suffixes(entries)  # a ValueError names a bad entry
        return entries

    @field_validator("forward_headers")
    @classmethod
    def _check_headers(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        lowered = tuple(name.strip().lower() for name in names)
        for name in lowered:
            if not name or not name.isascii() or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"{name!r} is not a header name")
            if name in _NEVER_FORWARDED:
                raise ValueError(f"the {name} header is never forwarded to workers")
        return lowered

    @field_validator("extra_fields")
    @classmethod
    def _check_fields(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if "rid" in names:
            raise ValueError("rid is set by the gateway on every upstream request")
        return names

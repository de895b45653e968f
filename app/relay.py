"""The relay loops: a worker's response out to the client, observed in passing.

This is the hot path. Per upstream chunk the stream loop does one clock read, the observer's
``endswith``/substring checks and the ASGI send of the very same bytes object: no JSON, no
pydantic, no copy, no timer (deadlines and keep-alives live in the request's ``Supervisor``).
"""

from __future__ import annotations

import contextlib

import httpx
import orjson

from app.accesslog import AccessRecord
from app.errors import UpstreamStreamBroken
from app.protocol import ParsedRequest
from app.streaming import Downstream, Supervisor
from app.upstream.client import map_transport_error
from app.upstream.sse import SSEObserver, Usage, parse_usage
from app.workers.worker import Worker


async def relay_stream(
    request: ParsedRequest,
    record: AccessRecord,
    started: float,
    worker: Worker,
    response: httpx.Response,
    down: Downstream,
    sup: Supervisor,
) -> None:
    """Relay an SSE stream. Sets ``record.ttft_ms`` at the commit point (first data event
    relayed); raises an ``UpstreamError`` if the stream fails or ends without ``[DONE]``."""
    obs = SSEObserver(drop_usage=not request.client_wants_usage)
    clock = sup.clock
    chunk_out = down.chunk
    chunks = response.aiter_raw()
    try:
        async for chunk in chunks:  # until the commit point
            sup.last_rx = clock()
            out = obs.feed(chunk)
            if out:
                await chunk_out(out)
                if obs.first_data:
                    record.ttft_ms = round((clock() - started) * 1000, 3)
                    break
        async for chunk in chunks:  # steady state
            sup.last_rx = clock()
            out = obs.feed(chunk)
            if out:
                await chunk_out(out)
        rest = obs.finish()
        if rest:
            await chunk_out(rest)
    except httpx.HTTPError as exc:
        raise map_transport_error(exc, worker, committed=obs.first_data) from None
    finally:
        record.chunks = obs.chunks
        set_usage(record, obs.usage)
    if not obs.done:
        broken = UpstreamStreamBroken(f"worker {worker.name} ended the stream without [DONE]")
        broken.retryable = not obs.first_data
        raise broken
    if obs.inband_error:
        record.outcome = "upstream_error"
    record.status = 200
    await down.end()


async def relay_whole(
    worker: Worker, response: httpx.Response, down: Downstream, record: AccessRecord
) -> None:
    """Relay a non-streamed response: the worker's bytes, read whole, sent as they are."""
    try:
        body = await response.aread()
    except httpx.HTTPError as exc:
        raise map_transport_error(exc, worker, committed=False) from None
    with contextlib.suppress(orjson.JSONDecodeError):
        set_usage(record, parse_usage(orjson.loads(body)))
    record.status = response.status_code
    content_type = response.headers.get("content-type", "application/json")
    await down.complete(response.status_code, body, content_type.encode("latin-1"))


def set_usage(record: AccessRecord, usage: Usage | None) -> None:
    if usage is not None:
        record.prompt_tokens = usage.prompt_tokens
        record.completion_tokens = usage.completion_tokens

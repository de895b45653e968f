"""The relay loops: a worker's response out to the client, observed in passing.

This is the hot path. Per upstream chunk the stream loop does one clock read (kept as the
attempt's ``last_rx``, which its idle deadline counts from), the observer's
``endswith``/``count``/substring checks, one list append (the chunk's time, for the inter-chunk
histogram, observed once at the end of the request) and one write of the very same bytes: no
JSON, no pydantic, no timer (deadlines and keep-alives live in the request's ``Supervisor``), no
metric update. Up to the commit point the chunks pass through the request's task and ASGI
``send``; after it, when the server offers ``app.proxy.direct`` and the worker connection is the
gateway's own (``Http1Response``), the same steps run in the upstream read callback and write
straight to the client's connection, so a chunk costs no task switch at all.

That is the OpenAI routes, whose observer is ``app.upstream.sse.SSEObserver``. A request of
another API (``app.proxy.surface``) brings its own observer, chosen once per request: the
Messages API's translates each worker event into Anthropic's (one orjson parse per event).

A non-streamed response is read for its usage and each choice's ``meta_info`` (the exact
acceptance length, asked for by the gateway) without building its document
(``app.proxy.answer``); the ``meta_info`` members are cut out of the client's copy unless the
client asked for them, the rest relayed byte for byte. Another API's surface, or an answer of
another shape, is parsed whole (orjson) and the surface translates it.
"""

from __future__ import annotations

import orjson

from app.errors import UpstreamBadResponse, UpstreamStreamBroken
from app.proxy.answer import NotJSON, read_answer
from app.proxy.attempt import Attempt
from app.proxy.downstream import Downstream
from app.proxy.request import ParsedRequest, Route
from app.proxy.surface import Observer
from app.upstream.client import UpstreamResponse, map_transport_error
from app.upstream.errors import TransportError
from app.upstream.sse import SSEObserver, parse_usage, take_meta_info

ACCEPT_LENGTH_HEADER = b"x-dflash-accept-length"


def _not_json(attempt: Attempt) -> UpstreamBadResponse:
    return UpstreamBadResponse(f"worker {attempt.worker.name} answered with no JSON object")


def _response(attempt: Attempt) -> UpstreamResponse:
    response = attempt.response
    assert response is not None, "relayed before the worker responded"
    return response


async def relay_stream(
    attempt: Attempt, down: Downstream, request: ParsedRequest, *, expose: bool = False
) -> None:
    """Relay an attempt's SSE stream, noting in ``attempt.tally`` what passes (the commit point:
    ``first_at``, the first data event relayed); raises an ``UpstreamError`` if the stream fails
    or ends without ``[DONE]``. ``expose``: add the estimated acceptance length to the usage
    chunk the client asked for."""
    obs: Observer
    if request.surface is None:
        # Chat streams send a role chunk first and a finish chunk last per choice: no verify step.
        overhead = 2 * request.choices if request.route is Route.CHAT else 0
        drop = not request.client_wants_usage
        obs = SSEObserver(drop_usage=drop, overhead=overhead, expose=expose)
    else:  # another API's events, translated from the worker's
        obs = request.surface.observer(request, expose=expose)
    response = _response(attempt)
    tally = attempt.tally
    clock = attempt.clock
    chunk_out = down.chunk
    stamp = tally.chunk_times.append
    chunks = response.aiter_raw()
    try:
        async for chunk in chunks:  # until the commit point
            attempt.last_rx = clock()
            out = obs.feed(chunk)
            if out:
                await chunk_out(out)
                if obs.first_data:
                    tally.first_at = clock()
                    break
        direct = down.direct()
        if direct is not None:
            # Steady state in the upstream connection's read callback: no task switch per chunk.
            write, feed = direct.write, obs.feed

            def sink(chunk: bytes) -> bool:
                attempt.last_rx = now = clock()
                out = feed(chunk)
                if out:
                    stamp(now)
                    return write(out)
                return False

            drain = direct.drain

            async def caught_up() -> None:  # once per pause, not per chunk
                await drain()
                attempt.held = clock()  # its connection waited for the client: not its silence

            await response.pump(sink, caught_up)
        else:
            async for chunk in chunks:  # steady state
                attempt.last_rx = now = clock()
                out = obs.feed(chunk)
                if out:
                    stamp(now)
                    await chunk_out(out)
        rest = obs.finish()
        if rest:
            await chunk_out(rest)
    except TransportError as exc:
        raise map_transport_error(exc, attempt.worker, committed=obs.first_data) from None
    finally:
        tally.events = obs.events
        if obs.usage is not None:
            tally.usage = obs.usage
    if not obs.done:
        broken = UpstreamStreamBroken(
            f"worker {attempt.worker.name} ended the stream without [DONE]"
        )
        broken.retryable = not obs.first_data
        raise broken
    tally.inband_error = obs.inband_error
    await down.end()


async def relay_whole(
    attempt: Attempt,
    down: Downstream,
    request: ParsedRequest,
    *,
    limit: int,
    expose: bool = False,
) -> None:
    """Relay a non-streamed response: the worker's bytes, read whole, sent as they are (less the
    ``meta_info`` the gateway asked for) as ``application/json``; a body that is not a JSON
    object, or one over ``limit`` bytes, is the worker's failure. ``expose``: the exact
    acceptance length as a header."""
    response = _response(attempt)
    try:
        body = await response.aread(limit)
    except TransportError as exc:
        raise map_transport_error(exc, attempt.worker, committed=False) from None
    attempt.tally.answer_bytes = len(body)
    strip = not request.client_wants_meta_info
    read = None
    if request.surface is None:
        try:
            read = read_answer(body, strip=strip)
        except NotJSON:
            raise _not_json(attempt) from None
    if read is not None:
        usage, steps, body = read
    else:  # another shape than SGLang's, or another API's surface: the whole document
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            raise _not_json(attempt)
        usage = parse_usage(doc)
        steps = take_meta_info(doc, strip=strip)
        if strip and b'"meta_info"' in body:
            body = orjson.dumps(doc)
        if request.surface is not None:
            body = request.surface.whole(doc, request)
    headers: list[tuple[bytes, bytes]] = []
    if usage is not None and steps is not None:
        usage.verify_steps, usage.exact = steps, True
        length = usage.accept_length
        if expose and length is not None:
            headers.append((ACCEPT_LENGTH_HEADER, f"{length:.4f}".encode()))
    if usage is not None:
        attempt.tally.usage = usage
    await down.complete(response.status_code, body, b"application/json", headers)

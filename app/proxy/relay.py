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

The observer is the request's surface's (``app.proxy.surface``), chosen once per request: on the
OpenAI routes ``app.upstream.sse.SSEObserver``; the Messages API's translates each worker event
into Anthropic's (one orjson parse per event).

A non-streamed response is the surface's too (``Surface.answer``): on the OpenAI routes it is
read for its usage and each choice's ``meta_info`` (the exact acceptance length, asked for by the
gateway) without building its document (``app.proxy.answer``), the ``meta_info`` members cut out
of the client's copy unless the client asked for them, the rest relayed byte for byte; another
API's surface parses it whole (orjson) and translates it.
"""

from __future__ import annotations

from collections.abc import Callable

from app.errors import UpstreamBadResponse, UpstreamStreamBroken
from app.proxy.answer import NotJSON
from app.proxy.attempt import Attempt
from app.proxy.continuation import Continuation, KeptReads, Resume
from app.proxy.downstream import Downstream
from app.proxy.request import ParsedRequest, Route
from app.upstream.client import UpstreamResponse, map_transport_error
from app.upstream.errors import TransportError
from app.workers.worker import Worker

ACCEPT_LENGTH_HEADER = b"x-dflash-accept-length"


def _not_json(attempt: Attempt) -> UpstreamBadResponse:
    return UpstreamBadResponse(f"worker {attempt.worker.name} answered with no JSON object")


def expected_id(attempt: Attempt, request: ParsedRequest) -> str | None:
    """The rid the worker's answer must carry (``app.upstream.sse.answers``), or None when its
    answer carries nothing to check: parallel samples (``n`` > 1, fresh ids on the worker),
    count_tokens (no id) and any answer of a vLLM worker (its ids are its own). Those requests go
    on a new connection instead (``checkable``)."""
    return attempt.rid if checkable(request, attempt.worker) else None


def checkable(request: ParsedRequest, worker: Worker) -> bool:
    """Whether the worker's answer to ``request`` says which request it answers."""
    engine = worker.engine
    return (
        request.choices == 1
        and request.route is not Route.COUNT_TOKENS
        and (engine is None or engine.answers_by_rid)
    )


def _response(attempt: Attempt) -> UpstreamResponse:
    response = attempt.response
    assert response is not None, "relayed before the worker responded"
    return response


async def relay_stream(
    attempt: Attempt,
    down: Downstream,
    request: ParsedRequest,
    *,
    expose: bool = False,
    stray: Callable[[], None] | None = None,
    cont: Continuation | None = None,
) -> None:
    """Relay an attempt's SSE stream, noting in ``attempt.tally`` what passes (the commit point:
    ``first_at``, the first data event relayed); raises an ``UpstreamError`` if the stream fails
    or ends without ``[DONE]``, ``UpstreamForeignAnswer`` if its first event answers another
    request. ``expose``: add the estimated acceptance length to the usage chunk the client
    asked for.

    The stream ends at the worker's ``[DONE]`` (the surface's end follows it at once): nothing
    after it is relayed or waited for. Its connection goes back to the pool only if the
    response's end follows with no byte more; data after ``[DONE]`` closes it and calls
    ``stray()`` (the client's answer stands: the worker is not blamed for it).

    A continuable stream passes its ``Continuation`` (``app.proxy.continuation``): its observer
    (it outlives the attempt), its kept reads (a reference to each read relayed) and, going on
    after a broken attempt, the ``Resume`` its reads go through first."""
    keep: KeptReads | None = None
    resume: Resume | None = None
    if cont is None:
        obs = request.surface.observer(request, expose=expose)
    else:
        obs, keep, resume = cont.obs, cont.kept, cont.resume
    if resume is None:
        obs.expect = expected_id(attempt, request)
    feed = obs.feed if resume is None else resume.wrap(obs.feed)
    fast_keep = resume is None and obs.holds_errors
    if keep is not None:
        feed = keep.keeping(feed, obs)
    response = _response(attempt)
    tally = attempt.tally
    clock = attempt.clock
    chunk_out = down.chunk
    stamp = tally.chunk_times.append
    chunks = response.aiter_raw()
    last: list[bytes] = []  # the stream's last piece, kept to go out with its end (one write)
    try:
        async for chunk in chunks:  # until the commit point
            attempt.last_rx = clock()
            out = feed(chunk)
            if out:
                await chunk_out(out)
                if obs.first_data:
                    if tally.first_at is None:  # a continuation keeps its stream's commit point
                        tally.first_at = clock()
                    break
        direct = down.direct()
        if obs.done:
            pass  # the whole stream came in the reads before the commit point
        elif direct is not None:
            # Steady state in the upstream connection's read callback: no task switch per chunk.
            write = direct.write
            # A continuable stream's first attempt on the OpenAI routes keeps each read right
            # here, the observer holding back errors itself: no extra call per chunk.
            kept = keep.chunks.append if keep is not None and fast_keep else None
            if kept is None:

                def sink(chunk: bytes) -> bool:
                    attempt.last_rx = now = clock()
                    out = feed(chunk)
                    if obs.done:  # the stream's end: nothing after it is read
                        response.stop()
                        return _last(out, now)
                    if out:
                        stamp(now)
                        return write(out)
                    return False

            else:
                feed_obs, keep_read = obs.feed, kept

                def sink(chunk: bytes) -> bool:
                    keep_read(chunk)
                    attempt.last_rx = now = clock()
                    out = feed_obs(chunk)
                    if obs.done:
                        response.stop()
                        return _last(out, now)
                    if out:
                        stamp(now)
                        return write(out)
                    return False

            def _last(out: bytes, now: float) -> bool:
                """The stream's last read: kept for ``end`` (unless it is cut short by a
                held-back error, whose relayed part goes out at once)."""
                if not out:
                    return False
                stamp(now)
                if obs.broken is not None:
                    return write(out)
                last.append(out)
                return False

            drain = direct.drain

            async def caught_up() -> None:  # once per pause, not per chunk
                await drain()
                attempt.held = clock()  # its connection waited for the client: not its silence

            await response.pump(sink, caught_up)
        else:
            async for chunk in chunks:  # steady state
                attempt.last_rx = now = clock()
                out = feed(chunk)
                if out:
                    stamp(now)
                    await chunk_out(out)
                if obs.done:
                    break
        if obs.broken is not None:  # a worker-fault error event, held back
            response.discard()
            raise obs.broken
        if obs.done:
            if obs.after_done:
                response.discard()
                if stray is not None:
                    stray()
            else:
                response.release_at_end(stray)
        else:
            if resume is not None:
                tail = resume.finish()
                if tail:
                    out = obs.feed(tail)
                    if out:
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
    await down.end(last[0] if last else b"")


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
    try:
        usage, steps, body = request.surface.answer(body, request, expected_id(attempt, request))
    except NotJSON:
        raise _not_json(attempt) from None
    headers: list[tuple[bytes, bytes]] = []
    if usage is not None and steps is not None:
        usage.verify_steps, usage.exact = steps, True
        length = usage.accept_length
        if expose and length is not None:
            headers.append((ACCEPT_LENGTH_HEADER, f"{length:.4f}".encode()))
    if usage is not None:
        attempt.tally.usage = usage
    await down.complete(response.status_code, body, b"application/json", headers)

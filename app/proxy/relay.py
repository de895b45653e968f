"""The relay loops: a worker's response out to the client, observed in passing.

This is the hot path. Per upstream chunk the stream loop does one clock read (kept as the
attempt's ``last_rx``, which its idle deadline counts from), the observer's
``endswith``/``count``/substring checks, one list append (the chunk's time, for the inter-chunk
histogram, observed once at the end of the request) and one write of the very same bytes: no
JSON, no pydantic, no timer (deadlines and keep-alives live in the request's ``Supervisor``), no
metric update. It runs in the upstream connection's read callback (``Http1Response.pump``) and
writes through the request's ``Writer`` (``app.proxy.writer``): under the gateway's own server a
started stream's chunk goes straight to the client's connection, so it costs no task switch at
all; the request's task wakes only for what must be awaited (a part through ASGI ``send``, a
client that is behind).

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

    One loop, in the upstream connection's read callback (``Http1Response.pump``): each read is
    observed and its bytes handed to the request's writer (``app.proxy.writer``), which either
    writes them at once (the server's lane, a started stream: no task switch per chunk) or keeps
    them until ``pump`` awaits ``flush`` (ASGI ``send``; a client that is behind). The commit
    point is the loop's state: before it, the bytes go through ``Downstream`` (the first starts
    the response) and a failure may be retried; after it, straight to the writer, each read's
    time noted for the inter-chunk histogram.

    The stream ends at the worker's ``[DONE]`` (the surface's end follows it at once, with the
    stream's last piece, in one write): nothing after it is relayed or waited for. Its connection
    goes back to the pool only if the response's end follows with no byte more; data after
    ``[DONE]`` closes it and calls ``stray()`` (the client's answer stands: the worker is not
    blamed for it).

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
    keep_read = None
    if keep is not None:
        if resume is None and obs.holds_errors:
            # The observer holds back errors itself: each read kept right here, one call less.
            obs.hold_errors = True
            keep_read = keep.chunks.append
        else:
            feed = keep.keeping(feed, obs)
    response = _response(attempt)
    tally = attempt.tally
    clock = attempt.clock
    writer = down.writer
    start = down.put
    stamp = tally.chunk_times.append
    committed = tally.first_at is not None  # a continuation keeps its stream's commit point
    last: list[bytes] = []  # the stream's last piece, kept to go out with its end (one write)

    def take(chunk: bytes) -> bool:
        """One read; True when the writer must be flushed before the next."""
        nonlocal committed
        if keep_read is not None:
            keep_read(chunk)
        attempt.last_rx = now = clock()
        out = feed(chunk)
        if obs.done:  # the stream's end: nothing after it is read
            response.stop()
            if out and obs.broken is None:  # kept for the end (one write with it)
                last.append(out)
                if committed:
                    stamp(now)
                elif obs.first_data and tally.first_at is None:
                    tally.first_at = clock()
                return False
            # A held-back error cuts the stream short: the part before it goes out at once.
        if not out:
            return False
        if committed:
            stamp(now)
            return writer.put(out)
        waits = start(out)  # before the commit point (the first piece starts the response)
        if obs.first_data:
            committed = True
            if tally.first_at is None:
                tally.first_at = clock()
        return waits

    async def flush() -> None:  # once per pause, not per chunk
        await writer.flush()
        attempt.held = clock()  # its connection waited for the client: not its silence

    try:
        await response.pump(take, flush)
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
                        await down.chunk(out)
            rest = obs.finish()
            if rest:
                await down.chunk(rest)
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

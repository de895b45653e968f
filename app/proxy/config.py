"""The proxy's sections of ``app.config.Settings``: the deadlines a request is held to, toward the
workers and toward its client (``timeouts``), and how it is tried again (``retry``)."""

from __future__ import annotations

from pydantic import Field

from app.sections import Section


class TimeoutConfig(Section):
    """Deadlines toward the workers and toward the clients."""

    # Time to open a TCP connection to a worker.
    connect_s: float = Field(5.0, gt=0)
    # Time to the worker's response headers (prefill + queueing on the worker).
    first_byte_s: float = Field(300.0, gt=0)
    # Longest silence between two upstream reads once streaming.
    idle_s: float = Field(300.0, gt=0)
    # Send ``: keep-alive`` to the client after this many silent seconds.
    keepalive_s: float = Field(15.0, gt=0)
    # No limit on total stream duration unless set.
    total_s: float | None = Field(None, gt=0)
    # Slow clients (slowloris): the request line and headers must arrive within client_header_s
    # of the connection opening (or of the previous response), the body within client_body_s of
    # the headers; else 408 and the connection is closed.
    client_header_s: float = Field(10.0, gt=0)
    # The request body must arrive within this many seconds of the headers; else 408.
    client_body_s: float = Field(60.0, gt=0)
    # A client that takes none of a response's waiting bytes for client_write_s is cut off (the
    # connection closed, what was buffered dropped): any response, refusals included. Streams
    # are judged by their relay's own slow-reader guard (idle_s) while they run.
    client_write_s: float = Field(60.0, gt=0)
    # An idle client connection is kept this long: longer than client pools and load balancers
    # keep theirs (httpx 5 s, ALB 60 s), so a reused connection is never closed under a request.
    client_keepalive_s: float = Field(75.0, gt=0)
    # An idle connection to a worker is reused for this long, then closed. Keep it under the
    # worker's own idle timeout (SGLang: uvicorn's 5 s), or a request may be sent on a connection
    # the worker is closing at that moment.
    worker_keepalive_s: float = Field(4.0, gt=0)


class RetryConfig(Section):
    """Retries happen before the commit point; after it, a chat stream is continued (see
    docs/contracts.md)."""

    # Attempts per request, the first included; each retry goes to a worker not tried yet.
    max_attempts: int = Field(3, ge=1)
    # Pause before the first retry, doubled for each further one, with jitter (x 0.5-1).
    backoff_base_s: float = Field(0.05, ge=0)
    # The longest pause between two attempts.
    backoff_max_s: float = Field(1.0, ge=0)
    # No retry once this many seconds have passed since the request's first attempt.
    budget_s: float = Field(30.0, gt=0)
    # Continuations per chat stream that breaks after it began (worker killed, connection
    # reset, silent past timeouts.idle_s): the stream goes on on another worker from the text
    # relayed so far, and its client sees one stream (docs/routing.md). 0: off (an in-band
    # error ends the stream). 2 rides out a second worker lost during the first continuation.
    mid_stream_attempts: int = Field(2, ge=0, le=8)

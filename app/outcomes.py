"""How a proxied request, and each upstream attempt of it, ended.

One enum for the proxy, the relay, the metrics and the access log. The values are the label values
of ``dflash_gateway_stream_outcomes_total{outcome}`` and ``upstream_attempts_total{outcome}`` and
the access log's ``outcome`` field, so they never change; being ``str`` members, they are written
as their value wherever a string goes (labels, JSON, ``key=value`` lines).
"""

from __future__ import annotations

import enum


class Outcome(enum.StrEnum):
    # A request (the access log's outcome; stream_outcomes_total for streams).
    OK = "ok"  # also an attempt that relayed the whole response
    CLIENT_DISCONNECT = "client_disconnect"  # the client left (status 499)
    # The client read nothing for timeouts.idle_s while it had bytes waiting: the gateway hung up
    # on it and aborted its request on the worker (status 499, no fault of the worker's).
    CLIENT_TOO_SLOW = "client_too_slow"
    UPSTREAM_ERROR = "upstream_error"  # the worker's error, or its in-band error event
    UPSTREAM_TIMEOUT = "upstream_timeout"  # a first-byte, idle or total deadline passed
    STREAM_BROKEN = "stream_broken"  # the worker's stream ended without [DONE]
    NO_WORKER = "no_worker"  # no healthy worker serves the model
    NO_CAPACITY = "no_capacity"  # every worker full: queue full or timed out
    SHUTDOWN = "shutdown"  # the gateway stopped while the request ran
    INTERNAL_ERROR = "internal_error"  # a fault in the gateway itself
    REJECTED = "rejected"  # refused before any worker was asked (4xx, or a protocol refusal)
    # An upstream attempt (upstream_attempts_total).
    CONNECT_ERROR = "connect_error"  # never reached the worker, or no response at all
    STATUS_ERROR = "status_error"  # the worker answered with an error status
    TIMEOUT = "timeout"  # no first byte, or silence, past its deadline
    BROKEN = "broken"  # the response failed part-way
    CANCELLED = "cancelled"  # the client left or the gateway stopped mid-attempt


STREAM_OUTCOMES = (
    Outcome.OK,
    Outcome.CLIENT_DISCONNECT,
    Outcome.CLIENT_TOO_SLOW,
    Outcome.UPSTREAM_ERROR,
    Outcome.UPSTREAM_TIMEOUT,
    Outcome.STREAM_BROKEN,
    Outcome.NO_WORKER,
    Outcome.NO_CAPACITY,
    Outcome.SHUTDOWN,
    Outcome.INTERNAL_ERROR,
)
ATTEMPT_OUTCOMES = (
    Outcome.OK,
    Outcome.CONNECT_ERROR,
    Outcome.STATUS_ERROR,
    Outcome.TIMEOUT,
    Outcome.BROKEN,
    Outcome.CANCELLED,
)

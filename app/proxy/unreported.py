"""What an answer whose worker reported no usage is taken to have cost (``unreported_usage``):
written into its access and usage records, flagged ``usage_estimated``, and charged to its key's
quotas, so that neither cutting an answer short nor a worker that leaves ``usage`` out costs its
key nothing, and a billing job reading the usage log sees what the quota was charged."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from app.outcomes import Outcome
from app.proxy.request import Route

if TYPE_CHECKING:
    from app.proxy.job import Job

# Decode speed of one request when its worker reported none (tokens per second): about what one
# request of a busy DFlash Kimi-K2.5 node generates (and the emulator at --speed 1).
NOMINAL_TOKENS_PER_S = 250.0


def unreported_usage(job: Job) -> tuple[int, int] | None:
    """An estimate of the prompt and completion tokens of a request whose worker reported no
    usage. Prompt: the upstream body's bytes / 4. Completion, bounded by ``max_tokens`` per
    choice when the request has a bound:

    - a stream that relayed data events (its client hung up, its worker died, or it never sent
      its usage chunk): the events relayed (less a chat stream's role and finish events) times
      the worker's mean acceptance length (tokens per event, at least 1);
    - a whole answer that came without ``usage``: its bytes / 4;
    - a whole answer the client hung up on (or the total deadline ended once the answer began)
      while its worker was still at it (a worker sends a whole answer only once it is done):
      the time since it was sent times one request's decode speed on that worker as the worker
      last reported it (``gen_throughput / num_running_reqs`` from ``/v1/loads``;
      ``NOMINAL_TOKENS_PER_S`` when it reported none), for each choice: about what the worker
      generated until the gateway's abort reached it;
    - a stream the client hung up on before its first event: its prompt alone.

    None when the usage is known, the request never reached a worker, or it failed there (an
    error status, a timeout, a dropped connection before any answer: the worker's fault, not
    spent on the client)."""
    attempt = job.attempt
    request = job.request
    if attempt is None or attempt.tally.usage is not None or request.route is Route.COUNT_TOKENS:
        return None
    tally = attempt.tally
    if tally.first_at is not None:
        overhead = 2 * request.choices if request.route is Route.CHAT else 0
        per_event = max(1.0, attempt.worker.load.accept_length or 1.0)
        completion = max(0, tally.events - overhead) * per_event
    elif tally.answer_bytes:
        completion = tally.answer_bytes / 4
    elif attempt.written and attempt.reason is Outcome.CANCELLED:
        load = attempt.worker.load
        rate = load.gen_throughput / max(1, load.running) if load.gen_throughput > 0 else 0.0
        rate = rate if math.isfinite(rate) and rate > 0 else NOMINAL_TOKENS_PER_S
        elapsed = max(0.0, attempt.clock() - attempt.started)
        completion = 0.0 if request.stream else elapsed * rate * request.choices
    else:
        return None
    if request.max_tokens is not None:
        completion = min(completion, request.max_tokens * request.choices)
    prompt = sum(len(part) for part in request.upstream_parts("")) // 4
    return prompt, math.ceil(completion)

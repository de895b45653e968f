"""The token counts and verify steps a worker reports, read without trusting them.

A stream's usage chunk and a whole answer's ``usage`` give token counts (``parse_usage``); SGLang's
``return_meta_info`` gives each choice's exact verify steps (``take_meta_info``). A count is taken
only as an integer from 0 to ``MAX_COUNT`` (``reported_count``). ``Usage.accept_length`` is
SGLang's ``spec_accept_length``, added to a client's usage as ``ACCEPT_LENGTH_FIELD`` when enabled.
"""

from __future__ import annotations

from dataclasses import dataclass

# The gateway's own field on the client's final usage chunk (``expose_accept_length``).
ACCEPT_LENGTH_FIELD = "spec_accept_length"


@dataclass(slots=True)
class Usage:
    """Token counts of one request as the worker reported them, and its verify steps: exact
    (``meta_info.spec_verify_ct``), estimated from the stream's chunks, or unknown (None)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    verify_steps: int | None = None
    exact: bool = False
    # Of prompt_tokens: those served from the worker's prefix cache
    # (``prompt_tokens_details.cached_tokens``; SGLang reports it with --enable-cache-report).
    cached_tokens: int | None = None

    @property
    def accept_length(self) -> float | None:
        """Completion tokens per verify step (SGLang's ``spec_accept_length``)."""
        if not self.verify_steps or self.completion_tokens is None:
            return None
        return self.completion_tokens / self.verify_steps


# No request's tokens or verify steps come near this; a larger count is a broken or hostile
# worker's, and would overflow the float of a metric or charge a tenant's quota for nothing.
MAX_COUNT = 1 << 31


def reported_count(v: object) -> int | None:
    """A count the worker reported (tokens, verify steps): an integer from 0 to ``MAX_COUNT``,
    else None (a negative one would run a counter backwards, which Prometheus refuses)."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT:
        return v
    return None


def parse_usage(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("completion_tokens_details")
    reasoning = usage.get("reasoning_tokens")
    if reasoning is None and isinstance(details, dict):
        reasoning = details.get("reasoning_tokens")
    prompt = usage.get("prompt_tokens_details")
    return Usage(
        reported_count(usage.get("prompt_tokens")),
        reported_count(usage.get("completion_tokens")),
        reported_count(reasoning),
        cached_tokens=reported_count(prompt.get("cached_tokens"))
        if isinstance(prompt, dict)
        else None,
    )


def take_meta_info(obj: object, *, strip: bool) -> int | None:
    """The request's verify steps from each choice's ``meta_info.spec_verify_ct`` (SGLang's
    ``return_meta_info``); ``meta_info`` is removed from the choices when ``strip``. None when no
    choice reports it (not a speculative-decoding worker, or an older one)."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list):
        return None
    steps: int | None = None
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        meta = choice.pop("meta_info", None) if strip else choice.get("meta_info")
        count = reported_count(meta.get("spec_verify_ct")) if isinstance(meta, dict) else None
        if count is not None and count > 0:
            steps = (steps or 0) + count
    return steps

"""The serving engine behind a worker: SGLang or vLLM, and everything that differs between them.

Routing, admission and the relay never ask which engine a worker runs: they read ``Worker.load``
(running, waiting, token usage, throughput, acceptance, capacity) and call ``Engine.abort``. Each
engine fills those from its own endpoints:

* **SGLang**: health ``GET /health``; load, capacity and acceptance from ``GET /v1/loads``
  (``app.workers.health.parse_loads``); abort ``POST /abort_request`` with the attempt's rid.
* **vLLM**: health ``GET /health``; load from its Prometheus ``GET /metrics``
  (``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, or
  ``vllm:gpu_cache_usage_perc`` before vLLM 0.10); throughput and acceptance as rates between two
  polls of its counters (``vllm:generation_tokens_total``; ``vllm:spec_decode_num_drafts_total``,
  ``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``: the acceptance length is
  ``1 + accepted / drafts``, as vLLM logs it, over the last ``ACCEPT_WINDOW_S``); capacity
  from ``max_num_seqs`` when the server reports it (``GET /server_info?config_format=json``,
  served with ``VLLM_SERVER_DEV_MODE=1``), else ``workers.vllm_max_num_seqs``; abort: nothing
  to send, vLLM aborts a request whose connection closes, and an attempt that ends early closes
  its connection (``app.upstream.http1``).

Per request, the acceptance length comes from SGLang's ``meta_info`` (non-streamed chat) or is
estimated from the stream's chunks (both engines send one chunk per verify step).

Which engine: ``workers.engine`` (``auto``, ``sglang``, ``vllm``), or per worker a URL scheme
``vllm+http://host:port`` / ``sglang+http://host:port``. ``auto`` detects it when the worker is
admitted (each time it becomes healthy): a ``/server_info`` document without ``vllm_config`` is
SGLang's; ``/version`` answered and ``/metrics`` carrying ``vllm:`` series is vLLM; anything else
is taken for SGLang (the gateway's behaviour before engines existed).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Literal, Protocol

from app.errors import UpstreamError
from app.upstream.client import UpstreamClient
from app.workers.worker import Worker, WorkerLoad


def _num(value: object, default: float = 0.0) -> float:
    """A finite number the worker reported, else ``default`` (a string, a bool, an int too large
    for a float, NaN or an infinity)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return default
    try:
        number = float(value)
    except OverflowError:
        return default
    return number if math.isfinite(number) else default


# Plausible per-worker speculative figures: an acceptance length counts the accepted draft tokens
# plus the bonus token of each verify step (at least 1, at most a draft block and then some); an
# acceptance rate is a fraction. Anything else would poison the estimates built on them.
_ACCEPT_LENGTH = (1.0, 64.0)
# No worker (or its ranks summed) runs, queues or holds more than this many requests or tokens, or
# generates this many tokens a second; a larger figure is a broken or hostile worker's, and would
# overflow an int conversion or drive the fleet saturation (the autoscaling signal) to absurd
# values.
MAX_COUNT = 1 << 31


def _count(value: object) -> int | None:
    """A count the worker reported: a finite number from 0 to ``MAX_COUNT``, else None."""
    number = _num(value, -1.0)
    return int(number) if 0 <= number <= MAX_COUNT else None


def _summed(ranks: list[dict[str, object]], field: str) -> int:
    """``field`` summed over the ranks that report it plausibly; 0 if the sum is not."""
    total = sum(c for c in (_count(r.get(field)) for r in ranks) if c is not None)
    return total if total <= MAX_COUNT else 0


def _capacity(ranks: list[dict[str, object]], field: str) -> int | None:
    """A limit summed over the ranks, None (unknown) unless every rank reports a plausible,
    positive one and their sum is plausible too."""
    counts = [_count(r.get(field)) for r in ranks]
    limits = [c for c in counts if c is not None and c > 0]
    if len(limits) < len(counts) or sum(limits) > MAX_COUNT:
        return None
    return sum(limits)


_TRANSFER_QUEUES = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
)


def _transfer_queue(ranks: list[dict[str, object]]) -> int:
    """The requests a PD worker holds for a KV transfer, summed over ranks (0 when none)."""
    sections = [r.get("disaggregation") for r in ranks]
    total = sum(
        _summed([s], name) for s in sections if isinstance(s, dict) for name in _TRANSFER_QUEUES
    )
    return total if total <= MAX_COUNT else 0


def parse_loads(data: object) -> WorkerLoad | None:
    """SGLang's ``/v1/loads`` document summed over data-parallel ranks (one rank with DFLASH).

    Every figure is taken only when finite and plausible, per rank and summed: counts from 0 to
    ``MAX_COUNT``, token usage a fraction, throughput from 0 to ``MAX_COUNT`` tokens/s; an
    implausible one counts as not reported (0; a capacity unknown, so the default cap applies)."""
    ranks = data.get("loads") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or not ranks:
        return None
    ranks = [r for r in ranks if isinstance(r, dict)]
    if not ranks:
        return None
    spec = [r.get("speculative") for r in ranks if isinstance(r.get("speculative"), dict)]
    low, high = _ACCEPT_LENGTH
    accept = [a for a in (_num(s.get("accept_length")) for s in spec) if low <= a <= high]
    rates = [r for r in (_num(s.get("accept_rate")) for s in spec) if 0 < r <= 1]
    usage = [u for u in (_num(r.get("token_usage")) for r in ranks) if 0 <= u <= 1]
    gen = sum(t for t in (_num(r.get("gen_throughput")) for r in ranks) if 0 <= t <= MAX_COUNT)
    return WorkerLoad(
        running=_summed(ranks, "num_running_reqs"),
        waiting=_summed(ranks, "num_waiting_reqs"),
        waiting_tokens=_summed(ranks, "num_waiting_uncached_tokens"),
        transfer_queue=_transfer_queue(ranks),
        token_usage=max(usage, default=0.0),
        gen_throughput=gen if gen <= MAX_COUNT else 0.0,
        accept_length=sum(accept) / len(accept) if accept else None,
        accept_rate=sum(rates) / len(rates) if rates else None,
        max_running_requests=_capacity(ranks, "max_running_requests"),
        max_total_num_tokens=_capacity(ranks, "max_total_num_tokens"),
    )


EngineName = Literal["sglang", "vllm"]
ENGINE_NAMES: tuple[EngineName, ...] = ("sglang", "vllm")
_SCHEMES = {f"{name}+http://": name for name in ENGINE_NAMES} | {
    f"{name}+https://": name for name in ENGINE_NAMES
}


def split_engine_url(url: str) -> tuple[EngineName | None, str]:
    """``vllm+http://h:p`` -> (``vllm``, ``http://h:p``); a plain URL -> (None, itself)."""
    for prefix, name in _SCHEMES.items():
        if url.startswith(prefix):
            return name, url[len(name) + 1 :]
    return None, url


class Engine(Protocol):
    """One worker's engine adapter (one instance per worker: it may keep state between polls)."""

    name: EngineName
    # Aborts are calls to the worker (counted as dflash_gateway_aborts_sent_total); False: the
    # closed connection is the abort and ``abort`` sends nothing.
    abort_by_call: bool
    # Its answers carry the attempt's rid as their id (SGLang), so a stray answer on a pooled
    # connection is recognised (``app.proxy.relay.checkable``); False: its requests go on a new
    # connection each.
    answers_by_rid: bool

    async def healthy(self, client: UpstreamClient, worker: Worker, timeout: float) -> bool: ...  # noqa: ASYNC109

    async def poll_load(
        self,
        client: UpstreamClient,
        worker: Worker,
        timeout: float,  # noqa: ASYNC109
    ) -> WorkerLoad | None: ...

    async def admit(self, client: UpstreamClient, worker: Worker, timeout: float) -> None: ...  # noqa: ASYNC109

    async def abort(self, client: UpstreamClient, worker: Worker, rid: str) -> bool: ...


async def _health(client: UpstreamClient, worker: Worker, timeout: float) -> bool:  # noqa: ASYNC109
    try:
        status, _ = await client.get(worker, "/health", timeout)
    except UpstreamError:
        return False
    return status == 200


_LOADS = "/v1/loads?include=core,spec"
_LOADS_PD = "/v1/loads?include=core,spec,disagg"


class SGLangEngine:
    """SGLang: ``/health``, ``/v1/loads``, ``/abort_request`` (the behaviour before engines)."""

    name: EngineName = "sglang"
    abort_by_call = True
    answers_by_rid = True

    async def healthy(self, client: UpstreamClient, worker: Worker, timeout: float) -> bool:  # noqa: ASYNC109
        return await _health(client, worker, timeout)

    async def admit(self, client: UpstreamClient, worker: Worker, timeout: float) -> None:  # noqa: ASYNC109
        """Nothing beyond the load poll (capacity is in ``/v1/loads``)."""

    async def poll_load(
        self,
        client: UpstreamClient,
        worker: Worker,
        timeout: float,  # noqa: ASYNC109
    ) -> WorkerLoad | None:
        # A PD worker's disaggregation queues too (a whole worker has none to report).
        path = _LOADS if worker.role == "whole" else _LOADS_PD
        try:
            status, data = await client.get(worker, path, timeout)
        except UpstreamError:
            return None  # the health check decides what a silent worker means
        return parse_loads(data) if status == 200 else None

    async def abort(self, client: UpstreamClient, worker: Worker, rid: str) -> bool:
        return await client.abort(worker, rid)


# The vLLM series the gateway reads (samples of every label set are summed: one per engine
# index with data parallelism). A counter's sample carries the ``_total`` suffix.
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_GENERATED = "vllm:generation_tokens_total"
_DRAFTS = "vllm:spec_decode_num_drafts_total"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_WANTED = frozenset((_RUNNING, _WAITING, *_KV_USAGE, _GENERATED, _DRAFTS, _DRAFT_TOKENS, _ACCEPTED))
_COUNTERS = (_GENERATED, _DRAFTS, _DRAFT_TOKENS, _ACCEPTED)
_MAX_METRICS_BODY = 4 * 1024 * 1024
# The span a vLLM worker's acceptance length and rate are read over (its counters' rates).
ACCEPT_WINDOW_S = 60.0


def parse_vllm_metrics(text: bytes) -> dict[str, float]:
    """The wanted vLLM samples of a Prometheus text exposition, summed per name over label sets
    (the usage gauge: the largest). Only finite, non-negative values up to ``MAX_COUNT`` count;
    a line that does not parse is skipped."""
    found: dict[str, float] = {}
    for raw in text.split(b"\n"):
        if not raw.startswith(b"vllm:"):
            continue
        line = raw.decode("utf-8", "replace")
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            end = line.rfind("}")
            if end < brace:
                continue
            rest = line[end + 1 :].split()
        else:
            name, *rest = line.split()
        if name not in _WANTED or not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if not math.isfinite(value) or not 0 <= value <= MAX_COUNT:
            continue
        if name in _KV_USAGE:
            found[name] = max(found.get(name, 0.0), value)
        else:
            found[name] = found.get(name, 0.0) + value
    return found


def _scheduler_max_num_seqs(data: object) -> int | None:
    """``vllm_config.scheduler_config.max_num_seqs`` of vLLM's ``/server_info`` (JSON form)."""
    config = data.get("vllm_config") if isinstance(data, dict) else None
    scheduler = config.get("scheduler_config") if isinstance(config, dict) else None
    seqs = scheduler.get("max_num_seqs") if isinstance(scheduler, dict) else None
    if isinstance(seqs, int) and not isinstance(seqs, bool) and 0 < seqs <= MAX_COUNT:
        return seqs
    return None


class VLLMEngine:
    """vLLM: ``/health``, Prometheus ``/metrics``, abort by closing the connection."""

    name: EngineName = "vllm"
    abort_by_call = False
    answers_by_rid = False  # its ids are "chatcmpl-" + its own uuid

    def __init__(
        self, default_max_num_seqs: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._default_seqs = default_max_num_seqs
        self._clock = clock
        self.max_num_seqs: int | None = None  # as the server reported it
        # (when, counters) of the polls of the last ``ACCEPT_WINDOW_S``, oldest first.
        self._samples: deque[tuple[float, dict[str, float]]] = deque()
        self._accept_length: float | None = None
        self._accept_rate: float | None = None
        self._throughput = 0.0

    async def healthy(self, client: UpstreamClient, worker: Worker, timeout: float) -> bool:  # noqa: ASYNC109
        return await _health(client, worker, timeout)

    async def admit(self, client: UpstreamClient, worker: Worker, timeout: float) -> None:  # noqa: ASYNC109
        """Read ``max_num_seqs`` where the server reports it; start the counter rates afresh (a
        restarted server's counters start at 0)."""
        self._samples.clear()
        try:
            status, data = await client.get(worker, "/server_info?config_format=json", timeout)
        except UpstreamError:
            status, data = 0, None
        self.max_num_seqs = _scheduler_max_num_seqs(data) if status == 200 else None

    async def poll_load(
        self,
        client: UpstreamClient,
        worker: Worker,
        timeout: float,  # noqa: ASYNC109
    ) -> WorkerLoad | None:
        try:
            status, body = await client.fetch(worker, "/metrics", timeout, _MAX_METRICS_BODY)
        except UpstreamError:
            return None
        if status != 200:
            return None
        return self.load_from(parse_vllm_metrics(body))

    def load_from(self, now: dict[str, float]) -> WorkerLoad | None:
        """The load of one ``/metrics`` scrape. Throughput: the rate since the previous scrape
        (as SGLang's last interval); acceptance: over the scrapes of the last
        ``ACCEPT_WINDOW_S`` (a slow-moving property of drafter and traffic, read over enough
        verify steps not to be noise)."""
        if _RUNNING not in now:
            return None  # not a vLLM exposition (or not yet serving)
        at = self._clock()
        samples = self._samples
        # A counter that went backwards: the server restarted; the window starts afresh.
        if samples and any(now.get(c, 0) < samples[-1][1].get(c, 0) for c in _COUNTERS):
            samples.clear()
            self._throughput = 0.0
        if samples and at > samples[-1][0]:
            last_at, last = samples[-1]
            self._throughput = (now.get(_GENERATED, 0) - last.get(_GENERATED, 0)) / (at - last_at)
        while len(samples) > 1 and samples[1][0] <= at - ACCEPT_WINDOW_S:
            samples.popleft()
        if samples:
            first = samples[0][1]
            drafts = now.get(_DRAFTS, 0) - first.get(_DRAFTS, 0)
            drafted = now.get(_DRAFT_TOKENS, 0) - first.get(_DRAFT_TOKENS, 0)
            accepted = now.get(_ACCEPTED, 0) - first.get(_ACCEPTED, 0)
            # No drafts in the window (idle): the last figures stand.
            if drafts > 0:
                self._accept_length = 1.0 + accepted / drafts
            if drafted > 0:
                self._accept_rate = min(1.0, accepted / drafted)
        samples.append((at, now))
        usage = next((now[k] for k in _KV_USAGE if k in now), 0.0)
        return WorkerLoad(
            running=int(min(now[_RUNNING], MAX_COUNT)),  # summed over label sets: bounded again
            waiting=int(min(now.get(_WAITING, 0), MAX_COUNT)),
            token_usage=min(1.0, usage),
            gen_throughput=self._throughput,
            accept_length=self._accept_length,
            accept_rate=self._accept_rate,
            max_running_requests=self.max_num_seqs or self._default_seqs,
        )

    async def abort(self, client: UpstreamClient, worker: Worker, rid: str) -> bool:
        """Nothing to send: the attempt's connection is closed, which aborts it in vLLM."""
        return True


def make_engine(
    name: EngineName, *, vllm_max_num_seqs: int, clock: Callable[[], float] = time.monotonic
) -> Engine:
    if name == "vllm":
        return VLLMEngine(vllm_max_num_seqs, clock)
    return SGLangEngine()


async def detect(client: UpstreamClient, worker: Worker, timeout: float) -> EngineName | None:  # noqa: ASYNC109
    """The engine a worker runs, from what it answers (see the module doc); None when it did not
    answer (a timeout, a dropped connection): it is asked again at the next health check rather
    than admitted under a guess."""
    try:
        status, data = await client.get(worker, "/server_info", timeout)
        if status == 200 and isinstance(data, dict) and "vllm_config" not in data:
            return "sglang"
        status, _ = await client.get(worker, "/version", timeout)
        if status == 200:
            status, body = await client.fetch(worker, "/metrics", timeout, _MAX_METRICS_BODY)
            if status == 200 and b"\nvllm:" in b"\n" + body:
                return "vllm"
    except UpstreamError:
        return None
    return "sglang"

"""Routing policies: one synchronous, I/O-free ``pick(ctx, workers) -> Worker`` each.

``workers`` is never empty: the caller passes the candidates that may take the request now
(routable, serving the model, under their admission cap, not already tried for this request).
Randomness comes from an injected ``random.Random`` so tests and benchmarks are reproducible.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from app.routing.prefix import PrefixBlocks
from app.workers.worker import Worker

if TYPE_CHECKING:
    from app.upstream.usage import Usage


@dataclass(frozen=True, slots=True)
class RoutingContext:
    model: str
    # prefix_affinity's key: X-Session-Id, else the request's `user`, else a conversation hash.
    routing_key: str | None = None
    # The prompt's block chain over its raw bytes (``app.routing.prefix``), for cache_aware.
    prefix: PrefixBlocks | None = None


class Policy(Protocol):
    name: str

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker: ...


@runtime_checkable
class Learns(Protocol):
    """A policy that learns from each answer (cache_aware: the worker's ``cached_tokens``) and
    hears when each request it routed is over."""

    def answered(self, ctx: RoutingContext, worker: Worker, usage: Usage) -> None: ...

    def released(self, ctx: RoutingContext) -> None: ...

    def recall(self, ctx: RoutingContext) -> Awaitable[None] | None:
        """What must be read before this request is picked (cache_aware: its session's home in
        the replicas' shared store), or None when nothing is."""
        ...


def _busy(worker: Worker) -> int:
    """Requests on the worker: ours in flight, or the worker's own running+waiting count when it
    reports more (other gateway replicas send to it too)."""
    return max(worker.in_flight, worker.load.running + worker.load.waiting)


def _load_key(worker: Worker) -> tuple[int, int, float]:
    return (worker.in_flight, worker.load.running + worker.load.waiting, worker.load.token_usage)


class LeastInflight:
    """Fewest in-flight requests through this gateway; ties broken by the worker's polled load
    (running + waiting, then KV-cache usage), then by name, so the choice is deterministic."""

    name = "least_inflight"

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        fewest = min(worker.in_flight for worker in workers)
        tied = [worker for worker in workers if worker.in_flight == fewest]
        if len(tied) == 1:
            return tied[0]
        return min(tied, key=lambda worker: (*_load_key(worker), worker.name))


class LeastQueued:
    """A prefill worker's pick (PD disaggregation): the fewest prompt tokens queued for prefill
    (its polled ``waiting_tokens``), then the fewest requests sent to it since that poll or
    waiting there, then in flight; ties go round the workers in turn (an idle pool shares the
    work rather than sending it all to one worker)."""

    name = "least_queued"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        count = len(workers)
        start = self._turn % count
        self._turn = start + 1
        best = workers[start]
        best_key = _queued_key(best)
        for i in range(1, count):
            worker = workers[(start + i) % count]
            key = _queued_key(worker)
            if key < best_key:
                best, best_key = worker, key
        return best


def _queued_key(w: Worker) -> tuple[int, int, int]:
    return (
        w.load.waiting_tokens,
        max(0, w.in_flight - w.in_flight_at_load) + w.load.waiting,
        w.in_flight,
    )


class PowerOfTwo:
    """Two distinct random candidates; the less loaded wins (power of two choices)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        if len(workers) == 1:
            return workers[0]
        first, second = self._rng.sample(range(len(workers)), 2)
        # Ties go to the first of the random pair, so equal workers share traffic evenly.
        return min(workers[first], workers[second], key=_load_key)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        return workers[next(self._counter) % len(workers)]


class Random:
    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        return workers[self._rng.randrange(len(workers))]


def _hash64(data: str) -> int:
    """A stable 64-bit hash (Python's ``hash`` is salted per process; replicas must agree)."""
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "big")


class PrefixAffinity:
    """Consistent hashing with bounded loads on the routing key.

    Every worker owns ``vnodes`` points on a hash ring derived only from its stable name, so every
    gateway replica maps a key to the same home worker with no shared state, and adding or removing
    a worker moves only that worker's share of keys. A worker is eligible only while its load is
    below ``max(min_bound, ceil(load_factor * (total load + 1) / n))``; past its home, the walk
    goes on clockwise, so a hot key spills to the next workers on the ring instead of piling onto
    one node (the cache-aware hot-spotting failure). Requests without a key go to ``fallback``.

    The ring holds every worker name seen recently; the walk skips names that are not candidates
    now, which equals a ring built from the candidates alone but avoids rebuilding it whenever a
    worker reaches its cap.
    """

    name = "prefix_affinity"

    def __init__(
        self,
        *,
        load_factor: float = 1.25,
        min_bound: int = 4,
        vnodes: int = 64,
        fallback: Policy | None = None,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self._load_factor = load_factor
        self._min_bound = min_bound
        self._vnodes = vnodes
        self._fallback = fallback or LeastInflight()
        self._names: set[str] = set()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ensure(self, names: Sequence[str]) -> None:
        missing = [name for name in names if name not in self._names]
        if not missing and len(self._names) <= 2 * len(names) + 16:
            return
        if len(self._names) + len(missing) > 2 * len(names) + 16:
            self._names = set()  # prune workers that left long ago
            missing = list(dict.fromkeys(names))
        self._names.update(missing)
        ring = list(zip(self._points, self._owners, strict=True))
        ring.extend((_hash64(f"{name}#{i}"), name) for name in missing for i in range(self._vnodes))
        ring = [(point, owner) for point, owner in ring if owner in self._names]
        ring.sort()
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def home(self, key: str, workers: Sequence[Worker]) -> Worker:
        """The key's worker ignoring load (what every replica agrees on)."""
        return self._walk(key, workers, bound=None)

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        if ctx.routing_key is None or len(workers) == 1:
            return self._fallback.pick(ctx, workers)
        total = sum(_busy(worker) for worker in workers)
        # A worker with a handful of requests (of DFLASH's 48) is not a hot spot: without the
        # floor, one request (or a stale polled count) at light load would break affinity.
        bound = max(self._min_bound, math.ceil(self._load_factor * (total + 1) / len(workers)))
        return self._walk(ctx.routing_key, workers, bound=bound)

    def _walk(self, key: str, workers: Sequence[Worker], *, bound: int | None) -> Worker:
        by_name = {worker.name: worker for worker in workers}
        self._ensure(list(by_name))
        start = bisect.bisect(self._points, _hash64(key))
        size = len(self._owners)
        seen: set[str] = set()
        for offset in range(size):
            name = self._owners[(start + offset) % size]
            worker = by_name.get(name)
            if worker is None or name in seen:
                continue
            if bound is None or _busy(worker) < bound:
                return worker
            seen.add(name)
            if len(seen) == len(by_name):
                break
        # Unreachable with load_factor >= 1 (some worker is always under the bound); be safe.
        return min(workers, key=_load_key)


_MASK64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (2**64 / golden ratio)


class SpareCapacity:
    """The worker with the most spare decode capacity, keeping a routing key on its worker.

    A worker's spare decode capacity is ``(capacity - busy) * rate * (1 - token_usage)``:
    ``capacity`` its reported ``max_running_requests``; ``busy`` its polled running + waiting
    plus the requests this gateway sent since that poll (``Worker.busy``); ``rate`` the output
    tokens per second a running request gets there, i.e. verify steps per second x acceptance
    length (``gen_throughput / running``), so a slower node or one whose drafter stopped matching
    its target is worth fewer slots (the last one measured while the worker is idle);
    ``token_usage`` its KV-cache fill. A worker that has never reported a rate counts at the best
    rate among the candidates, so it gets traffic and is measured. A full worker scores below
    every worker with room, the faster first.

    With a routing key, the key's home is the candidate with the highest rendezvous weight
    (a hash of key and worker name: every replica agrees, and a worker joining or leaving moves
    only its own keys) among those within ``load_factor`` of the best score; so a conversation
    stays where its prefix is cached until its worker is clearly worse off than the best one,
    then spills to the next worker by capacity. Two passes over the candidates, no containers.
    """

    name = "spare_capacity"

    def __init__(self, *, load_factor: float = 1.25) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self._load_factor = load_factor
        self._name_hashes: dict[str, int] = {}

    @staticmethod
    def score(worker: Worker, default_rate: float) -> float:
        """The worker's spare decode capacity (``pick`` computes the same inline)."""
        load = worker.load
        rate = worker.rate or default_rate
        spare = worker.room - worker.in_flight  # capacity - busy
        if spare <= 0:
            return (spare - 1) / rate  # full: the faster drains first
        return spare * rate * (1.0 - load.token_usage)

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        if len(workers) == 1:
            return workers[0]
        default_rate = 0.0
        for worker in workers:
            rate = worker.rate
            if rate is not None and rate > default_rate:
                default_rate = rate
        if default_rate == 0.0:
            default_rate = 1.0
        key = ctx.routing_key
        key_hash = _hash64(key) if key is not None else 0
        hashes = self._name_hashes
        if len(hashes) > 4 * len(workers) + 64:
            hashes.clear()  # forget workers that left long ago
        best = home = workers[0]
        best_score = home_score = -math.inf
        home_weight = -1
        # One pass: every worker's score (score() inlined: capacity - busy is room - in_flight)
        # and, with a key, its rendezvous weight.
        for worker in workers:
            load = worker.load
            spare = worker.room - worker.in_flight
            if spare > 0:
                usage = load.token_usage
                score = spare * (worker.rate or default_rate) * (1.0 - usage)
            else:
                score = (spare - 1) / (worker.rate or default_rate)
            if score > best_score:
                best, best_score = worker, score
            if key is not None:
                name_hash = hashes.get(worker.name)
                if name_hash is None:
                    name_hash = hashes[worker.name] = _hash64(worker.name)
                weight = ((key_hash ^ name_hash) * _MIX) & _MASK64
                if weight > home_weight:
                    home, home_weight, home_score = worker, weight, score
        if key is None or best_score <= 0:
            return best
        floor = best_score / self._load_factor
        if home_score >= floor:
            return home
        # The key's home is clearly worse off: the next worker by weight that is not.
        spill, spill_weight = best, -1
        for worker in workers:
            weight = ((key_hash ^ hashes[worker.name]) * _MIX) & _MASK64
            if weight > spill_weight and self.score(worker, default_rate) >= floor:
                spill, spill_weight = worker, weight
        return spill


def make_prefill_policy(name: str, *, load_factor: float = 1.25) -> Policy:
    """A prefill pool's policy: least_queued, or prefix_affinity falling back to it."""
    if name == "prefix_affinity":
        return PrefixAffinity(load_factor=load_factor, fallback=LeastQueued())
    return LeastQueued()


def make_policy(
    name: str,
    *,
    rng: random.Random,
    load_factor: float = 1.25,
    on_decision: Callable[[str], None] | None = None,
) -> Policy:
    """The policy called ``name`` (docs/contracts.md lists the names); ``on_decision``: told why
    each request went where it did (cache_aware's reasons)."""
    if name == "cache_aware":
        from app.routing.cache_aware import CacheAware  # it builds on this module

        return CacheAware(load_factor=load_factor, on_decision=on_decision)
    if name == "least_inflight":
        return LeastInflight()
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random(rng)
    if name == "prefix_affinity":
        return PrefixAffinity(load_factor=load_factor)
    if name == "spare_capacity":
        return SpareCapacity(load_factor=load_factor)
    if name == "least_queued":
        return LeastQueued()
    raise ValueError(f"unknown routing policy {name!r}")

"""``cache_aware``: where each prompt prefix lives (raw-byte block chains per worker), and picks
that weigh the prefill a worker's cache saves against the load it adds."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

from app.routing.cache_aware import CacheAware
from app.routing.cache_index import PrefixIndex
from app.routing.policies import RoutingContext, make_policy
from app.routing.prefix import BLOCK_BYTES, prefix_blocks
from app.upstream.usage import Usage
from app.workers.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from app.workers.worker import Worker, WorkerLoad, WorkerState

SYSTEM = b'"You are a coding agent. ' + b"Follow the repository's conventions. " * 1300 + b'"'


def _worker(i: int, **load: float) -> Worker:
    worker = Worker(url=f"http://10.0.0.{i}:30000", state=WorkerState.HEALTHY)
    for _ in range(3):
        worker.set_load(WorkerLoad(max_total_num_tokens=1_000_000, **load))  # type: ignore[arg-type]
    return worker


@dataclass
class Session:
    """An agent session: the shared system prompt, its own context, then turns."""

    index: int
    turns: int = 0

    def parts(self) -> list[bytes]:
        own = f'"Repository {self.index}: '.encode() + b"src/module.py " * 2500 + b'"'
        parts = [b"system", SYSTEM, b"user", own]
        for turn in range(self.turns):
            parts += [b"assistant", f'"answer {turn}"'.encode()]
            parts += [b"user", f'"turn {turn}: '.encode() + b"more " * 300 + b'"']
        return parts

    def ctx(self) -> RoutingContext:
        return RoutingContext(
            "m", f"s:{self.index}", prefix_blocks(self.parts(), lead_parts=2, new_parts=2)
        )


def test_a_later_turn_shares_every_whole_block_of_the_earlier_one() -> None:
    first = Session(1, turns=2)
    earlier = prefix_blocks(first.parts())
    first.turns = 3
    later = prefix_blocks(first.parts())
    assert earlier is not None and later is not None
    whole = [k for k, end in zip(earlier.keys, earlier.ends, strict=True) if end % BLOCK_BYTES == 0]
    assert len(whole) >= 10 and list(later.keys[: len(whole)]) == whole
    # One byte changed early on: no block from there on matches.
    parts = first.parts()
    parts[1] = parts[1][:5000] + b"X" + parts[1][5001:]
    changed = prefix_blocks(parts)
    assert changed is not None
    assert changed.keys[0] == later.keys[0] and set(changed.keys[1:]).isdisjoint(later.keys)


def test_the_index_estimates_the_held_prefix_and_forgets_beyond_capacity() -> None:
    index = PrefixIndex()
    index.set_capacity("a", "http://a", 40_000)
    session = Session(1, turns=1)
    blocks = session.ctx().prefix
    assert blocks is not None
    assert index.held_tokens("a", blocks) == 0
    index.record("a", blocks)
    assert index.held_tokens("a", blocks) == index.tokens(blocks.size)
    session.turns = 2
    longer = session.ctx().prefix
    assert longer is not None
    held = index.held_tokens("a", longer)
    assert (
        index.tokens(blocks.size) - index.tokens(BLOCK_BYTES) <= held <= index.tokens(blocks.size)
    )
    # Other sessions fill the worker's 40k tokens: the first one's deep blocks go first, and its
    # leading blocks (the shared system prompt, touched by every session) stay.
    for i in range(2, 6):
        other = Session(i).ctx().prefix
        assert other is not None
        index.record("a", other)
    assert index.worker_tokens("a") <= 40_000
    assert index.held_tokens("a", longer) <= index.tokens(len(SYSTEM) + BLOCK_BYTES)
    assert index.held_tokens("a", longer) >= index.tokens(len(SYSTEM) - BLOCK_BYTES)


def _once(policy: CacheAware, session: Session, workers: list[Worker]) -> Worker:
    """One request of ``session``, over before the next."""
    ctx = session.ctx()
    worker = policy.pick(ctx, workers)
    policy.released(ctx)
    return worker


def _run(policy: CacheAware, workers: list[Worker], sessions: list[Session]) -> list[Worker]:
    picks = []
    for session in sessions:
        worker = policy.pick(session.ctx(), workers)
        worker.in_flight += 1
        picks.append(worker)
    return picks


def test_a_shared_system_prompt_does_not_pile_sessions_on_one_worker() -> None:
    workers = [_worker(i) for i in range(3)]
    policy = CacheAware()
    sessions = [Session(i) for i in range(60)]
    picks = _run(policy, workers, sessions)
    counts = Counter(w.name for w in picks)
    assert len(counts) == 3 and max(counts.values()) <= 1.5 * min(counts.values())
    # Every later turn of a session goes where its first one went (its cache), even though every
    # worker now holds the shared prompt.
    for session, first in zip(sessions, picks, strict=True):
        session.turns = 1
        assert policy.pick(session.ctx(), workers) is first


def test_replicas_that_never_saw_a_session_agree_on_its_worker() -> None:
    workers = [_worker(i) for i in range(3)]
    one, other = CacheAware(), CacheAware()
    sessions = [Session(i) for i in range(30)]
    homes = []
    for session in sessions:  # one at a time: each over before the next
        ctx = session.ctx()
        homes.append(one.pick(ctx, workers))
        one.released(ctx)
    for session, home in zip(sessions, homes, strict=True):
        session.turns = 2
        ctx = session.ctx()
        assert other.pick(ctx, workers) is home
        other.released(ctx)
    # A busy home keeps a session with history on every replica, as on the one that placed it
    # (its index), while the history saves more than the extra load costs ...
    session, home = sessions[0], homes[0]
    for worker in workers:
        worker.in_flight = 4
    home.in_flight = 7
    session.turns = 3
    assert one.pick(session.ctx(), workers) is home
    assert CacheAware().pick(session.ctx(), workers) is home
    # ... while a new session whose first worker that is goes elsewhere.
    fresh = next(s for s in (Session(100 + i) for i in range(50)) if _top(s, workers) is home)
    assert CacheAware().pick(fresh.ctx(), workers) is not home


def _top(session: Session, workers: list[Worker]) -> Worker:
    """The session's first worker with no load anywhere."""
    idle = [_worker(int(w.name.split(".")[3].split(":")[0])) for w in workers]
    name = CacheAware().pick(session.ctx(), idle).name
    return next(w for w in workers if w.name == name)


def test_a_session_follows_its_cache_when_its_home_evicted_it() -> None:
    workers = [_worker(i) for i in range(3)]
    policy = CacheAware()
    session = Session(7, turns=3)
    home = _once(policy, session, workers)
    # Its home is too busy for a turn: it spills, and the spill worker computes the history.
    home.in_flight = 30
    spilled = _once(policy, session, workers)
    assert spilled is not home
    home.in_flight = 0
    # The home then evicts it (KV events: every block cleared).
    policy.index.kv_events(home.url, [AllBlocksCleared()], gap=False)
    session.turns = 4
    assert _once(policy, session, workers) is spilled


def test_a_worker_holding_the_history_keeps_it_at_a_bounded_extra_load() -> None:
    workers = [_worker(i) for i in range(3)]
    policy = CacheAware()
    session = Session(3, turns=4)
    home = _once(policy, session, workers)
    session.turns = 5
    for worker in workers:
        worker.in_flight = 10
    home.in_flight = 16  # past the balance bound (1.1 x the mean), but it saves the prefill
    assert _once(policy, session, workers) is home
    home.in_flight = 40  # far more loaded than the others: the prefill is not worth it
    assert _once(policy, session, workers) is not home


def test_the_answers_cached_tokens_correct_a_worker_that_evicts_faster() -> None:
    workers = [_worker(i) for i in range(2)]
    policy = CacheAware()
    session = Session(5, turns=2)
    worker = _once(policy, session, workers)
    before = policy.index.worker_tokens(worker.name)
    ctx = session.ctx()
    policy.pick(ctx, workers)
    assert ctx.prefix is not None and ctx.prefix.picked is not None
    assert ctx.prefix.picked[1] > 0  # it expected a hit ...
    prompt = 40_000
    for _ in range(20):  # ... the worker keeps answering that it held nothing
        policy.answered(ctx, worker, Usage(prompt_tokens=prompt, cached_tokens=0))
    assert policy.index.worker_tokens(worker.name) < before


def test_kv_events_evict_what_the_worker_removed() -> None:
    workers = [_worker(i) for i in range(2)]
    policy = CacheAware()
    session = Session(9)
    worker = policy.pick(session.ctx(), workers)
    held = policy.index.worker_tokens(worker.name)
    stored = [BlockStored((i,), i - 1 if i else None, tuple(range(64)), 64) for i in range(200)]
    policy.index.kv_events(worker.url, stored, gap=False)
    assert policy.index.worker_tokens(worker.name) == held
    policy.index.kv_events(worker.url, [BlockRemoved(tuple(range(100)))], gap=False)
    assert policy.index.worker_tokens(worker.name) <= held - 6400 + 2 * 1024


def test_answers_teach_the_token_ratio() -> None:
    policy = CacheAware()
    workers = [_worker(0)]
    ctx = Session(1).ctx()
    policy.pick(ctx, workers)
    assert ctx.prefix is not None
    for _ in range(200):
        policy.answered(ctx, workers[0], Usage(prompt_tokens=ctx.prefix.size // 3))
    assert abs(policy.index.tokens(3000) - 1000) < 20


def test_without_a_prompt_it_routes_as_spare_capacity() -> None:
    workers = [_worker(i) for i in range(4)]
    policy = make_policy("cache_aware", rng=random.Random(0))
    for _ in range(40):
        policy.pick(RoutingContext("m"), workers).in_flight += 1
    assert [w.in_flight for w in workers] == [10, 10, 10, 10]


def test_decisions_are_told_with_their_reason() -> None:
    reasons: list[str] = []
    workers = [_worker(i) for i in range(3)]
    policy = CacheAware(on_decision=reasons.append)
    policy.pick(RoutingContext("m"), workers)
    policy.pick(RoutingContext("m"), workers[:1])
    session = Session(2, turns=2)
    home = _once(policy, session, workers)
    home.in_flight = 30
    _once(policy, session, workers)
    home.in_flight = 0
    policy.index.forget(home.name)
    _once(policy, session, workers)
    assert reasons == ["no_key", "single", "affinity", "spill", "cache_hit"]


def test_hashing_a_200k_token_prompt_costs_at_most_2_ms_more_than_a_2k_one() -> None:
    big = [b"system", SYSTEM, b"user", b"x" * 760_000]
    small = [b"system", b"y" * 2000, b"user", b"z" * 6000]

    def cost(parts: list[bytes]) -> float:
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            prefix_blocks(parts)
            runs.append(time.perf_counter() - start)
        return min(runs)

    assert cost(big) - cost(small) < 0.002  # 1 ms on an idle core; shared CI runners are not


def _measured(i: int, throughput: float) -> Worker:
    worker = Worker(url=f"http://10.0.1.{i}:30000", state=WorkerState.HEALTHY)
    load = WorkerLoad(running=10, gen_throughput=throughput, max_running_requests=48)
    for _ in range(3):  # polled a few times: the rate is averaged over busy polls
        worker.set_load(load)
    worker.set_load(WorkerLoad(max_running_requests=48))  # idle now; the rate is kept
    return worker


def test_a_slow_or_collapsed_worker_gets_less_of_a_burst() -> None:
    # Output tokens per second per request: a normal node, one twice as slow, one whose
    # drafter stopped matching (~3.5x fewer tokens per step).
    normal, slow, collapsed = _measured(1, 900.0), _measured(2, 450.0), _measured(3, 260.0)
    workers = [normal, slow, collapsed]
    policy = CacheAware()
    for i in range(60):  # single-turn requests, each its own conversation
        ctx = RoutingContext("m", f"c:{i}", prefix_blocks([b"user", b'"q%d"' % i], new_parts=2))
        policy.pick(ctx, workers).in_flight += 1
    assert normal.in_flight > slow.in_flight > collapsed.in_flight


def test_rates_within_the_band_count_as_equal() -> None:
    # 900 vs 700 tokens/s per request is measurement noise between equal nodes, not a slower
    # one: a burst is shared evenly.
    a, b = _measured(1, 900.0), _measured(2, 700.0)
    policy = CacheAware()
    for _ in range(40):
        policy.pick(RoutingContext("m"), [a, b]).in_flight += 1
    assert (a.in_flight, b.in_flight) == (20, 20)


def test_a_history_stays_on_its_busy_worker_unless_another_would_be_far_sooner_done() -> None:
    workers = [_worker(i) for i in range(3)]
    policy = CacheAware()
    session = Session(11, turns=3)
    home = _once(policy, session, workers)
    # Every worker has as much prefill queued by other sessions (ours, in flight): the history's
    # worker keeps it, however long the queue (moving it would add its whole prefill).
    others = [(Session(200 + i).ctx()) for i in range(30)]
    placed = [(ctx, policy.pick(ctx, workers)) for ctx in others]
    queued = [policy.pending_tokens(w.name) for w in workers]
    assert min(queued) > 0
    session.turns = 4
    assert _once(policy, session, workers) is home
    # The other workers are done with theirs while the home is not: its turn goes where it is
    # done sooner even with the history to prefill again.
    for ctx, worker in placed:
        if worker is not home:
            policy.released(ctx)
    session.turns = 5
    assert _once(policy, session, workers) is not home


def test_every_request_gives_back_the_prefill_it_queued() -> None:
    workers = [_worker(i) for i in range(3)]
    policy = CacheAware()
    contexts = [Session(i, turns=i % 3).ctx() for i in range(20)]
    for ctx in contexts:
        policy.pick(ctx, workers)
    assert sum(policy.pending_tokens(w.name) for w in workers) > 0
    retried = contexts[0]
    policy.pick(retried, workers)  # a retry: the first pick's share is given back
    for ctx in contexts:
        policy.released(ctx)
    assert [policy.pending_tokens(w.name) for w in workers] == [0, 0, 0]

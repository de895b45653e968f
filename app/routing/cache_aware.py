"""``cache_aware``: the prefill a worker's prefix cache saves, against the load it adds.

Per candidate, two figures: its spare decode capacity (``SpareCapacity.score``: free slots x
output rate per request x free KV) and the prompt tokens it is estimated to hold of this request
(``app.routing.cache_index``, from the raw-byte block chain of ``app.routing.prefix``).

1. Every worker whose spare capacity is within ``load_factor`` of the best is *in the band*.
   The request's **home** is the band's worker with the highest rendezvous weight of its routing
   key (``X-Session-Id``, ``user``, Claude Code's ``metadata.user_id``, Responses'
   ``prompt_cache_key``, else the conversation hash): a hash of key and worker name, so every
   gateway replica, with no shared state, sends a session's turns to the same worker; a key
   whose first choice is out of the band spills to the next by weight (``spill``). Without a key
   the home is the worker with the most spare capacity (``no_key``).
2. **Long prompts** (``long_prompt`` tokens or more past the shared lead) go by their prefill
   (``_by_prefill``): the prompt tokens queued on each worker plus what it would compute of
   this one; a new session spreads from its home by that, a history stays where it is held
   unless an idle worker is far sooner done. Replicas learn where another placed a session from
   ``shared_homes`` (Redis), else from the rendezvous prior.
3. **Cache override** (short prompts). A worker that holds at least ``min_gain`` of the prompt
   more than the home (in tokens) takes the request instead (``cache_hit``), if its spare
   capacity is within ``load_factor x (1 + gain)`` of the best, ``gain`` being that extra share
   of the prompt: the more prefill it saves, the more load it may carry. So a session follows
   its cache when it spilled or when its home evicted it, and the shared system prompt (held by
   every worker that served anyone) never draws a fleet onto its first worker: it is no gain
   over a home that holds it too, and a gain is only worth a bounded load.
4. When every worker is full, the fastest to drain (``full``).

The chosen worker is recorded as holding the whole prompt, and the answer's ``cached_tokens``
corrects the estimate (``answered``); its estimated uncached tokens count as queued on that
worker until the request ends (``released``). ``pick`` stays synchronous and I/O-free: the block
chain is hashed before it, when the request is parsed, and the shared store read before it
(``recall``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence

from app.routing.cache_index import PrefixIndex
from app.routing.policies import _MASK64, _MIX, RoutingContext, _hash64
from app.routing.prefix import PrefixBlocks
from app.routing.shared_homes import SessionHomes
from app.upstream.usage import Usage
from app.workers.worker import Worker

_RATE_BAND = 1.5
REASONS = ("cache_hit", "affinity", "spill", "no_key", "full", "single")


class CacheAware:
    name = "cache_aware"

    def __init__(
        self,
        *,
        load_factor: float = 1.25,
        balance: float = 1.1,
        min_bound: int = 2,
        min_gain: float = 0.5,
        long_prompt: int = 2048,
        stay: float = 1.0,
        index: PrefixIndex | None = None,
        homes: SessionHomes | None = None,
        on_decision: Callable[[str], None] | None = None,
    ) -> None:
        if load_factor < 1.0:
            raise ValueError("load_factor must be >= 1")
        self._load_factor = load_factor
        self._min_gain = min_gain
        self._long = long_prompt  # prompt tokens past the lead worth routing by prefill
        self._stay = stay  # how much more busy a history's worker may be, in its prefills
        self._balance = balance
        self._min_bound = min_bound
        self.index = index or PrefixIndex()
        self.homes = homes  # shared by the replicas (Redis), when configured
        self._name_hashes: dict[str, int] = {}
        self._on_decision = on_decision
        # Per worker: the prompt tokens it has still to prefill for this gateway's requests in
        # flight there (each one's estimate at its pick, given back when it ends).
        self._pending: dict[str, int] = {}

    def pick(self, ctx: RoutingContext, workers: Sequence[Worker]) -> Worker:
        blocks = ctx.prefix
        if len(workers) == 1:
            worker, reason = workers[0], "single"
        else:
            worker, reason = self._choose(ctx, workers)
        if self._on_decision is not None:
            self._on_decision(reason)
        if blocks is not None:
            index = self.index
            if index.workers > 4 * len(workers) + 64:
                index.retain(w.name for w in workers)  # forget workers that left long ago
                pending = self._pending
                for name in [n for n in pending if n not in index.held_map]:
                    del pending[name]
            if blocks.picked is not None:  # a retry or a continuation: the last pick is over
                self._release(blocks)
            name = worker.name
            index.set_capacity(name, worker.url, worker.load.max_total_num_tokens)
            held = index.held_tokens(name, blocks)
            blocks.picked = (name, held)
            pending = self._pending
            pending[name] = pending.get(name, 0) + self._uncached(blocks, held)
            index.record(name, blocks)
            key, homes = ctx.routing_key, self.homes
            if homes and key and name != blocks.home and self.long_prompt(blocks):
                homes.remember(key, name)  # the session moved: tell the other replicas
                blocks.home = name
        return worker

    def recall(self, ctx: RoutingContext) -> Awaitable[None] | None:
        """With the replicas' shared store: read where a keyed long prompt's session was last
        sent (before ``pick``; nothing to await otherwise)."""
        blocks, key, homes = ctx.prefix, ctx.routing_key, self.homes
        if homes is None or blocks is None or key is None or not self.long_prompt(blocks):
            return None
        return self._recall(homes, key, blocks)

    @staticmethod
    async def _recall(homes: SessionHomes, key: str, blocks: PrefixBlocks) -> None:
        blocks.home = await homes.lookup(key)

    def long_prompt(self, blocks: PrefixBlocks) -> bool:
        """A prompt routed by its prefill (``_by_prefill``): long past its shared lead."""
        index = self.index
        return index.tokens(blocks.size) - index.tokens(blocks.lead) >= self._long

    def _uncached(self, blocks: PrefixBlocks, held: int) -> int:
        return max(0, self.index.tokens(blocks.size) - held)

    def _release(self, blocks: PrefixBlocks) -> None:
        picked = blocks.picked
        if picked is None:
            return
        name, held = picked
        left = self._pending.get(name, 0) - self._uncached(blocks, held)
        if left > 0:
            self._pending[name] = left
        else:
            self._pending.pop(name, None)

    def pending_tokens(self, worker: str) -> int:
        """Prompt tokens this gateway's requests in flight on ``worker`` were estimated to
        leave it to prefill."""
        return self._pending.get(worker, 0)

    def _choose(self, ctx: RoutingContext, workers: Sequence[Worker]) -> tuple[Worker, str]:
        default_rate = 0.0
        for worker in workers:
            rate = worker.rate
            if rate is not None and rate > default_rate:
                default_rate = rate
        if default_rate == 0.0:
            default_rate = 1.0
        # Rates within ``_RATE_BAND`` of the best count as the best: measured rates of equal
        # workers differ with their traffic (a worker prefilling long prompts streams less for a
        # while), and moving a session off its cache for that noise costs a whole prefill. A
        # slower node (x2) or a collapsed drafter (~3.5x fewer tokens per step) still counts.
        equal = default_rate / _RATE_BAND
        blocks = ctx.prefix
        index = self.index
        prompt = index.tokens(blocks.size) if blocks is not None else 0
        # Free slots x output rate per request (spare_capacity's score without its KV-usage
        # weight: an agent's 40k-token turns lock most of a worker's pool while they run, and
        # weighting by free KV would send every turn away from the cache it needs; a worker
        # short of KV queues the request, which its polled waiting count then shows).
        key = ctx.routing_key
        key_hash = _hash64(key) if key is not None else 0
        hashes = self._name_hashes
        if len(hashes) > 4 * len(workers) + 64:
            hashes.clear()  # forget workers that left long ago
        held_map = index.held_map
        first = blocks.keys[0] if blocks is not None and blocks.keys else None
        scores: list[float] = []
        loads: list[float] = []
        held: list[int] = []
        weights: list[int] = []
        best, best_score = workers[0], -math.inf
        most_held = 0
        total_busy = total_weight = 0.0
        for worker in workers:
            name = worker.name
            rate = worker.rate or default_rate
            if rate >= equal:
                rate = default_rate
            spare = worker.room - worker.in_flight
            score = spare * rate if spare > 0 else (spare - 1) / rate
            scores.append(score)
            if score > best_score:
                best, best_score = worker, score
            own = 0
            if first is not None:
                have = held_map.get(name)
                if have is not None and first in have.blocks:
                    own = index.held_tokens(name, blocks)  # type: ignore[arg-type]
                    if own > most_held:
                        most_held = own
            held.append(own)
            # Requests on it (Worker.busy, inlined) per unit of speed: what the balance bound
            # compares.
            load = worker.load
            in_flight = worker.in_flight
            busy = max(
                in_flight, load.running + load.waiting + in_flight - worker.in_flight_at_load
            )
            weight = rate / default_rate
            loads.append(busy / weight)
            total_busy += busy
            total_weight += weight
            if key is not None:
                name_hash = hashes.get(name)
                if name_hash is None:
                    name_hash = hashes[name] = _hash64(name)
                weights.append(((key_hash ^ name_hash) * _MIX) & _MASK64)
        if best_score <= 0:
            return best, "full"
        # How far past the bands each worker is (<= 0: within both), as the share of the prompt
        # its cache would have to save to make up for it: spare capacity within load_factor of
        # the best, and requests per unit of speed within ``balance`` x the fleet's mean (else
        # a cap of 48 leaves sessions, each with one request at a time, far from balanced).
        bound = max(self._min_bound, self._balance * (total_busy + 1) / total_weight)
        floor = best_score / self._load_factor
        past = [
            max(floor / score - 1.0, load / bound - 1.0) if score > 0 else math.inf
            for score, load in zip(scores, loads, strict=True)
        ]
        home, reason = best, "no_key"
        top, top_past = best, 0.0
        if key is not None:
            top_weight = home_weight = -1
            for worker, over, weight in zip(workers, past, weights, strict=True):
                if weight > top_weight:
                    top, top_weight, top_past = worker, weight, over
                if over <= 0.0 and weight > home_weight:
                    home, home_weight = worker, weight
            reason = "affinity" if home is top else "spill"
        if blocks is None or prompt <= 0:
            return home, reason
        # Only what a worker holds past the shared lead (tools and system prompt) counts: what
        # this session sent. A shared system prompt is soon held by every worker that served
        # anyone; counting it would draw every new session to the first one that did.
        lead = index.tokens(blocks.lead)
        if prompt - lead >= self._long:  # long_prompt(blocks)
            return self._by_prefill(ctx, blocks, workers, (home, reason), top, past, held)
        home_held = max(lead, held[workers.index(home)])
        need = home_held + self._min_gain * (prompt - lead)
        choice, choice_held = home, need
        for worker, over, own in zip(workers, past, held, strict=True) if most_held >= need else ():
            if own < choice_held or worker is home:
                continue
            if over <= (own - home_held) / prompt and (own > choice_held or choice is home):
                choice, choice_held = worker, own
        if choice is not home:
            return choice, "cache_hit"
        if reason == "spill" and home_held <= lead:
            # The prior every replica shares (see ``_by_prefill``).
            history = index.tokens(blocks.last) - lead
            if history >= self._min_gain * (prompt - lead) and top_past <= history / prompt:
                return top, "affinity"
        return home, reason

    def _by_prefill(
        self,
        ctx: RoutingContext,
        blocks: PrefixBlocks,
        workers: Sequence[Worker],
        chosen: tuple[Worker, str],
        top: Worker,
        past: list[float],
        held: list[int],
    ) -> tuple[Worker, str]:
        """A long prompt goes where it waits least for its prefill. Per worker with a free
        slot: the prompt tokens it has still to prefill (this gateway's in flight there, or
        everyone's as it last reported), plus what it would compute of this prompt, plus how
        far it is past the decode bands as that share of the prompt. A new session takes its
        home unless another worker is ``min_gain`` of its own part sooner done (so sessions
        spread by the prefill they queue, not by their count); a session with history stays on
        the worker holding it unless the fleet has an idle worker far sooner done."""
        home, reason = chosen
        index = self.index
        prompt, lead = index.tokens(blocks.size), index.tokens(blocks.lead)
        known = max(held) > lead
        # Where the session's history is believed to be beyond this replica's own index: the
        # worker the replicas' shared store names (the latest any replica sent it to), else,
        # when this replica never saw the session, its key's first worker (where every replica
        # sends it while that worker is not far busier).
        history = index.tokens(blocks.last) - lead
        named = blocks.home
        prior = next((i for i, w in enumerate(workers) if w.name == named), -1) if named else -1
        if prior < 0 and not known and ctx.routing_key is not None and history > 0:
            prior = workers.index(top)
        pending = self._pending
        costs: list[float] = []
        queues: list[int] = []
        haves: list[int] = []
        for i, worker in enumerate(workers):
            have = max(lead, held[i], lead + history if i == prior else 0)
            haves.append(have)
            over = past[i]
            if over == math.inf:  # no free slot
                costs.append(math.inf)
                queues.append(0)
                continue
            queued = max(pending.get(worker.name, 0), worker.load.waiting_tokens)
            queues.append(queued)
            # Past the decode bands, the excess counts as that share of the prompt.
            costs.append(queued + prompt - have + max(0.0, over) * prompt)
        # Where it stays unless another worker is far less busy: the worker holding most of its
        # history, else its home. A new session spreads by the prefill it queues (it moves when
        # another worker would be done ``min_gain`` of its own part sooner). Moving a history
        # off its cache adds its whole prefill to the fleet's work, worth it only while another
        # worker, about to have nothing to prefill, would still be done far sooner with that
        # prefill (``stay``: its whole wait times 1 + stay): the fleet has an idle worker. While
        # every worker is busy, a move only adds work: the makespan is each worker's sessions.
        h = workers.index(home)
        most = max(range(len(workers)), key=haves.__getitem__)
        best = min(range(len(workers)), key=costs.__getitem__)
        if haves[most] > lead:
            idle = queues[best] <= prompt - lead  # about to have nothing to prefill
            if idle and costs[most] > (1.0 + self._stay) * costs[best]:
                return workers[best], "spill"
            if most == h:
                return home, reason
            return workers[most], "affinity" if most == prior else "cache_hit"
        if costs[best] + self._min_gain * (prompt - lead) < costs[h]:
            return workers[best], "spill"
        return home, reason

    def answered(self, ctx: RoutingContext, worker: Worker, usage: Usage) -> None:
        """The worker's answer to a request this policy routed: its usage corrects the index."""
        blocks = ctx.prefix
        if blocks is not None and usage.prompt_tokens:
            self.index.answered(worker.name, blocks, usage.prompt_tokens, usage.cached_tokens)

    def released(self, ctx: RoutingContext) -> None:
        """The request is over, however it ended: its prefill is no longer queued anywhere."""
        blocks = ctx.prefix
        if blocks is not None:
            self._release(blocks)
            blocks.picked = None

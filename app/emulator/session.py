"""One request's life on the emulated worker: admission, prefill, verify steps, accounting.

``start()`` takes a running slot (or waits in the queue, or raises ``QueueFull``) and sleeps the
prefill time, shortened by the prefix cache. ``steps()`` then sleeps one verify step at the
current batch size before each step it yields. ``finish()`` releases the slot and records ground
truth and metrics exactly once, whatever ended the request.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from app.emulator.decode_role import DecodeSide
from app.emulator.disagg import RoomUse
from app.emulator.engine import ActiveRequest, QueueFull
from app.emulator.generation import Generation, Step
from app.emulator.genrequest import GenRequest
from app.emulator.prefill_role import PrefillSide
from app.emulator.profiles import PROFILE_NAMES, classify
from app.emulator.worker import EmulatedWorker


def request_rng(req: GenRequest, fallback: random.Random) -> random.Random:
    """Deterministic for (prompt, seed) when seeded or greedy; otherwise from the worker's rng."""
    if req.seed is None and req.temperature > 0:
        return random.Random(fallback.getrandbits(64))
    material = f"{req.kind}|{req.seed}|{req.prompt}".encode()
    return random.Random(int.from_bytes(hashlib.blake2b(material, digest_size=8).digest()))


def pick_profile(header: str | None, configured: str, req: GenRequest) -> str:
    if header and header.lower() in PROFILE_NAMES:
        return header.lower()
    if configured != "auto":
        return configured
    return classify(req.last_user)


class Session:
    def __init__(
        self,
        worker: EmulatedWorker,
        req: GenRequest,
        profile_header: str | None = None,
        request_id: str | None = None,
    ):
        side = worker.disagg
        if isinstance(side, PrefillSide):
            # A prefill server answers with the one token its prefill sampled (``prefill.py``).
            limit = req.max_tokens
            req = replace(req, max_tokens=1 if limit is None or limit > 1 else limit)
        self.worker = worker
        self.req = req
        self.request_id = request_id  # the client's X-Request-Id, as forwarded by a gateway
        self.rid = req.rid or f"{worker.rng.getrandbits(128):032x}"
        self.profile = pick_profile(profile_header, worker.config.profile, req)
        clock = worker.clock
        self.created = int(clock.time())
        self.active = ActiveRequest(
            rid=self.rid,
            profile=self.profile,
            stream=req.stream,
            started=clock.time(),
            started_mono=clock.monotonic(),
            priority=req.priority,
        )
        collapse = worker.faults.accept_collapse
        if collapse is None:
            model = worker.models.get(self.profile, req.temperature)
        else:
            model = worker.models.collapsed(collapse)
        self.gen = Generation(req, self.profile, model, request_rng(req, worker.rng))
        self._step_factor = worker.step_factors.get(self.profile, 1.0)
        self.prompt_tokens = req.prompt_tokens + self.gen.prefix_tokens
        self.cached_tokens = 0
        self._cache_path: list[bytes] = []  # the prompt's cached pages, locked while it runs
        self.first_token: float | None = None
        self.prefill_s = 0.0
        self.decode_s = 0.0  # the verify steps' modelled durations, summed
        self.chunks_sent = 0
        self._holding_slot = False
        self._finished = False
        self._counted_tokens = 0
        # Verify steps run here: not on a prefill server (its one token comes from the prefill).
        self.verifies = not isinstance(side, PrefillSide)
        self.room_use = RoomUse(req.bootstrap_room, None, clock.time())
        worker.stats.count("requests")
        worker.scheduler.register(self.active)

    @property
    def aborted(self) -> str | None:
        return self.active.aborted

    async def start(self) -> None:
        """Admission and prefill; raises ``QueueFull`` when the waiting queue is full. Under
        disaggregation (``app.emulator.disagg``) a prefill server first waits for the decode
        side's destination and "transfers" the KV after its prefill; a decode server waits for
        the transfer instead of prefilling. Both raise ``TransferFailed`` as SGLang aborts."""
        w = self.worker
        side = w.disagg
        if side is None:
            await self._admit_and_prefill()
            return
        side.check(self)
        if isinstance(side, DecodeSide):
            if await side.receive(self):
                await self._admit_and_prefill(prefill=False)
            return
        room = await side.bootstrap(self)
        try:
            if not self.aborted:
                side.prefilling(True)
                try:
                    await self._admit_and_prefill()
                finally:
                    side.prefilling(False)
            side.transfer(self, room)
        finally:
            side.abandon(self, room)

    async def _admit_and_prefill(self, prefill: bool = True) -> None:
        w = self.worker
        try:
            self._holding_slot = await w.scheduler.acquire(self.active)
        except QueueFull as refused:
            w.scheduler.unregister(self.active)
            w.stats.count("queue_rejected")
            self._finished = True
            if w.disagg is not None:  # no request record, but the room's
                self.room_use.outcome, self.room_use.reason = "refused", refused.message
                w.disagg.record(self, self.room_use, {"prompt_tokens": self.prompt_tokens})
            raise
        w.metrics.on_queued(w.clock.monotonic() - self.active.started_mono)
        if not self._holding_slot:
            return
        if not prefill:  # a decode server's KV came from the prefill server
            w.running_tokens += self.prompt_tokens
            self._counted_tokens = self.prompt_tokens
            return
        cache = w.cache
        keys = cache.keys(self.req.prompt)
        held: list[bytes] = []

        def start() -> int:  # its batch is formed: its KV is allocated, the cache matched now
            nonlocal held
            w.running_tokens += self.prompt_tokens
            self._counted_tokens = self.prompt_tokens
            self.cached_tokens, held = cache.match(keys, self.prompt_tokens)
            self._hold(held)
            uncached = self.prompt_tokens - self.cached_tokens
            self.prefill_s = w.timing.prefill_s(uncached)  # its own cost, without the queue
            return uncached

        waiting = self.prompt_tokens - cache.peek(keys, self.prompt_tokens)
        await w.prefill.prefill(waiting, start)
        if self.active.aborted:
            return
        # The prompt's pages enter the cache once its prefill is done (SGLang's
        # ``cache_unfinished_req``); what running requests hold outside it, this prompt's pages
        # no longer counted there, bounds the cache.
        outside = (
            w.running_tokens - w.cached_running_tokens - (len(keys) - len(held)) * cache.page_size
        )
        path = cache.insert(self.req.prompt, keys, held, outside)
        self._release_path()
        self._hold(path)

    def _hold(self, path: list[bytes]) -> None:
        self._cache_path = path
        self.worker.cached_running_tokens += len(path) * self.worker.cache.page_size

    def _release_path(self) -> None:
        w = self.worker
        w.cache.unlock(self._cache_path)
        w.cached_running_tokens -= len(self._cache_path) * w.cache.page_size
        self._cache_path = []

    async def steps(self) -> AsyncIterator[Step]:
        w = self.worker
        while not self.gen.done:
            if self.active.aborted:
                self.gen.abort()
                return
            step_s = w.timing.step_s(w.running, self._step_factor) if self.verifies else 0
            self.decode_s += step_s
            await asyncio.sleep(step_s)
            if self.active.aborted:
                self.gen.abort()
                return
            step = self.gen.next_step()
            if step is None:
                return
            if self.first_token is None:
                self.first_token = w.clock.time()
                w.metrics.on_first_token(
                    self.req.stream, w.clock.monotonic() - self.active.started_mono
                )
            w.running_tokens += step.tokens
            self._counted_tokens += step.tokens
            if self.verifies:
                w.on_tokens(step.tokens, 1)
                w.metrics.on_steps(step.tokens, step_s)
            yield step

    @property
    def verify_steps(self) -> int:
        return len(self.gen.step_tokens) if self.verifies else 0

    def usage_counts(self) -> tuple[int, int, int, int | None]:
        cached = self.cached_tokens if self.worker.config.enable_cache_report else None
        return (self.prompt_tokens, self.gen.completion_tokens, self.gen.reasoning_tokens, cached)

    def meta_info(self) -> dict[str, Any]:
        gen = self.gen
        finish: dict[str, Any] | None = None
        if gen.finish_reason is not None:
            finish = {"type": gen.finish_reason}
            if gen.finish_reason in ("stop", "tool_calls"):
                finish["matched"] = gen.matched_stop
        info: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": finish,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": gen.reasoning_tokens,
            "completion_tokens": gen.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": self.worker.clock.monotonic() - self.active.started_mono,
        }
        steps = self.verify_steps
        if steps:
            proposed = steps * 7
            info.update(
                spec_accept_rate=gen.correct_drafts / proposed,
                spec_accept_length=gen.completion_tokens / steps,
                spec_num_correct_drafts=gen.correct_drafts,
                spec_num_proposed_drafts=proposed,
                spec_verify_ct=steps,
                spec_accept_histogram=gen.histogram(),
                spec_correct_drafts_histogram=gen.histogram(),
            )
        return info

    def finish(self, error: str | None = None) -> None:
        """Release the slot and record the request; the first call counts, later ones do nothing.
        Called before the last bytes go out, so a client that saw the end finds the record."""
        if self._finished:
            return
        self._finished = True
        w = self.worker
        if self.active.aborted:
            self.gen.abort()
        if self._holding_slot:
            w.scheduler.release()
            self._holding_slot = False
        w.scheduler.unregister(self.active)
        w.running_tokens -= self._counted_tokens
        self._release_path()
        gen = self.gen
        steps = self.verify_steps
        e2e = w.clock.monotonic() - self.active.started_mono
        if self.active.aborted:
            w.metrics.on_abort()
        w.metrics.on_finish(
            stream=self.req.stream,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=gen.completion_tokens,
            verify_steps=steps,
            e2e_s=e2e,
            finish_reason=gen.finish_reason,
        )
        if error is not None:
            w.stats.count("failed")
        w.stats.add(
            {
                "rid": self.rid,
                "request_id": self.request_id,
                "kind": self.req.kind,
                "index": self.req.index,
                "profile": self.profile,
                "stream": self.req.stream,
                "priority": self.req.priority,
                "steps": steps,
                "tokens_per_step": list(gen.step_tokens) if self.verifies else [],
                "completion_tokens": gen.completion_tokens,
                "reasoning_tokens": gen.reasoning_tokens,
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "prefill_s": self.prefill_s,
                "decode_s": self.decode_s,
                "spec_accept_length": gen.completion_tokens / steps if steps else None,
                "finish_reason": gen.finish_reason,
                "aborted": self.active.aborted,
                "error": error,
                "chunks_sent": self.chunks_sent,
                "started": self.active.started,
                "first_token": self.first_token,
                "finished": w.clock.time(),
                "bootstrap_room": self.req.bootstrap_room,
            }
        )
        if w.disagg is not None:
            w.disagg.record(self, self.room_use, {"prompt_tokens": self.prompt_tokens})

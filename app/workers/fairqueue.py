"""The order in which requests waiting for a worker slot are served.

Strict priority between classes: a waiter of a higher class is always served before any of a
lower one. Within a class, weighted fair queuing across API keys (start-time fair queuing, each
request costing 1): every key has its own FIFO lane; a lane's next request carries a virtual
start tag, and the lane with the smallest tag is served next. A served lane's next tag is its
last one plus ``1 / weight``; a lane that was idle starts at the class's virtual time (the tag
served last), or where its key's last request left it if that is later. So keys that keep
waiting share freed slots in proportion to their weights (3 : 1 for weights 3 and 1), and a key
that was not waiting is served at the next freed slot, not behind another key's backlog. Equal
tags go to the lane with fewer waiters, then to the one that started waiting first.

Costs: enqueue and removal O(1) (a removed waiter is skipped when its lane reaches it, or
dropped once they outnumber the lane's live ones: amortised O(1)), serving
O(keys waiting in the class). Nothing is allocated per request but a lane when its key starts
waiting.
"""

from __future__ import annotations

import asyncio
import collections


class Waiter:
    """One request waiting for a slot (``Admission`` owns its life)."""

    __slots__ = ("displaced", "future", "granted", "hops", "key", "lane", "level", "weight")

    def __init__(self, key: str | None, weight: float, level: int) -> None:
        self.key = key
        self.weight = weight
        self.level = level
        self.lane: _Lane | None = None  # set while queued
        self.future: asyncio.Future[None] | None = None  # resolved when granted a slot
        self.granted = False
        self.hops = 0  # waiters this wake-up was passed through before it reached this one
        self.displaced = False  # a full queue gave its place to a waiter served before it


class _Lane:
    __slots__ = ("live", "start", "step", "waiters")

    def __init__(self, start: float, step: float) -> None:
        self.waiters: collections.deque[Waiter] = collections.deque()
        self.live = 0
        self.start = start  # virtual start tag of the lane's next request
        self.step = step  # 1 / weight


class _Class:
    __slots__ = ("finish", "lanes", "vtime")

    def __init__(self) -> None:
        self.lanes: dict[str | None, _Lane] = {}
        self.vtime = 0.0  # the start tag served last
        # Each key's last finish tag (start + 1 / weight of its last request served): a key that
        # comes back at once does not start ahead of where its share left it. One entry per key
        # name (configured names: bounded).
        self.finish: dict[str | None, float] = {}


class FairQueue:
    """Waiters by priority class (``levels`` of them, higher served first) and key."""

    def __init__(self, levels: int) -> None:
        self._classes = [_Class() for _ in range(levels)]
        self.size = 0  # waiters queued (read it, never set it)

    def push(self, waiter: Waiter, *, front: bool = False) -> None:
        """Queue ``waiter`` at the back of its key's lane (``front``: at the front, for a waiter
        that gave back a slot it could not use)."""
        cls = self._classes[waiter.level]
        lane = cls.lanes.get(waiter.key)
        if lane is None:
            start = max(cls.vtime, cls.finish.get(waiter.key, 0.0))
            lane = cls.lanes[waiter.key] = _Lane(start, 1.0 / waiter.weight)
        if front:
            lane.waiters.appendleft(waiter)
        else:
            lane.waiters.append(waiter)
        lane.live += 1
        waiter.lane = lane
        self.size += 1

    def remove(self, waiter: Waiter) -> None:
        """Take a queued ``waiter`` out (it left, or timed out); its lane skips it later."""
        lane = waiter.lane
        if lane is None:
            return
        waiter.lane = None
        lane.live -= 1
        self.size -= 1
        if lane.live == 0:
            lanes = self._classes[waiter.level].lanes
            if lanes.get(waiter.key) is lane:
                del lanes[waiter.key]
        elif len(lane.waiters) > 2 * lane.live + 16:
            # A lane that is not served (a higher class takes every slot) while its waiters come
            # and go: drop the ones that left, or they would pile up for as long as it waits.
            lane.waiters = collections.deque(w for w in lane.waiters if w.lane is lane)

    def displace(self, newcomer: Waiter) -> Waiter | None:
        """With the queue full: take out and return the waiter that would be served last, when
        ``newcomer`` would be served before it (a higher class, or an earlier tag in the same
        class: another key than the one holding the queue); else None. So one key's burst that
        fills the queue cannot shut the other keys out."""
        level = next((n for n, cls in enumerate(self._classes) if cls.lanes), None)
        if level is None or level > newcomer.level:
            return None
        low = self._classes[level]
        last = max(low.lanes.values(), key=lambda lane: lane.start + (lane.live - 1) * lane.step)
        if level == newcomer.level:
            lane = low.lanes.get(newcomer.key)
            if lane is None:
                tag = max(low.vtime, low.finish.get(newcomer.key, 0.0))
            else:
                tag = lane.start + lane.live * lane.step
            if tag >= last.start + (last.live - 1) * last.step:
                return None
        victim = next(w for w in reversed(last.waiters) if w.lane is last)
        self.remove(victim)
        return victim

    def pop(self) -> Waiter | None:
        """The waiter to serve next (out of the queue), or None when nobody waits."""
        for cls in reversed(self._classes):
            lanes = cls.lanes
            if not lanes:
                continue
            lane = _next_lane(lanes)
            waiter = lane.waiters.popleft()
            while waiter.lane is not lane:  # removed earlier
                waiter = lane.waiters.popleft()
            waiter.lane = None
            self.size -= 1
            cls.vtime = lane.start
            lane.start += lane.step
            cls.finish[waiter.key] = lane.start
            lane.live -= 1
            if lane.live == 0:
                del lanes[waiter.key]
            return waiter
        return None


def _next_lane(lanes: dict[str | None, _Lane]) -> _Lane:
    """The lane with the smallest start tag; on a tie the one with fewer waiters, then the one
    that started waiting first."""
    best: _Lane | None = None
    for lane in lanes.values():
        if (
            best is None
            or lane.start < best.start
            or (lane.start == best.start and lane.live < best.live)
        ):
            best = lane
    assert best is not None
    return best

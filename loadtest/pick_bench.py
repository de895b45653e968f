"""Micro-benchmark of routing ``pick`` per policy and pool size: ``make bench-pick``.

Prints microseconds per pick (best of 5 runs) for n = 1, 16, 256 workers, with load on the workers
so the load-aware policies have something to compare (``spare_capacity``: rates and KV usage
too), and a fresh routing key per pick for ``prefix_affinity``, ``spare_capacity`` and
``cache_aware`` (the key hash is part of their cost); ``cache_aware`` also gets each request's
block chain of a 2k-token (8 KB) chat prompt, a shared system prompt then its own text (hashed
when the request is parsed, outside ``pick``; its lookups and recording are in).
"""

from __future__ import annotations

import random
import timeit

from app.routing.policies import RoutingContext, make_policy
from app.routing.prefix import prefix_blocks
from app.workers.worker import Worker, WorkerLoad, WorkerState

POLICIES = (
    "least_inflight",
    "power_of_two",
    "round_robin",
    "random",
    "prefix_affinity",
    "spare_capacity",
    "cache_aware",
)
SIZES = (1, 16, 256)


def _pool(n: int, rng: random.Random) -> list[Worker]:
    workers = []
    for i in range(n):
        worker = Worker(url=f"http://10.1.{i // 250}.{i % 250}:30000", state=WorkerState.HEALTHY)
        worker.in_flight = rng.randrange(0, 48)
        running = rng.randrange(0, 48)
        worker.set_load(
            WorkerLoad(
                running=running,
                waiting=rng.randrange(0, 4),
                token_usage=rng.random() / 2,
                gen_throughput=running * rng.uniform(20.0, 90.0),
                accept_length=rng.uniform(1.3, 5.5),
                max_running_requests=48,
            )
        )
        workers.append(worker)
    return workers


def measure(policy_name: str, n: int, number: int = 2000) -> float:
    rng = random.Random(0)
    workers = _pool(n, rng)
    policy = make_policy(policy_name, rng=rng)
    system = b'"' + b"You are a careful agent. " * 120 + b'"'
    contexts = [
        RoutingContext(
            model="m",
            routing_key=f"session-{i}",
            prefix=prefix_blocks(
                [b"system", system, b"user", f'"{i}: '.encode() + b"code " * 1000 + b'"'],
                lead_parts=2,
            ),
        )
        for i in range(number)
    ]
    policy.pick(contexts[0], workers)  # build any cached state outside the timing
    it = iter(contexts * 6)
    best = min(timeit.repeat(lambda: policy.pick(next(it), workers), number=number, repeat=5))
    return best / number * 1e6


def main() -> None:
    print(f"{'policy':<16}" + "".join(f"{f'n={n} (µs)':>14}" for n in SIZES))
    for name in POLICIES:
        print(f"{name:<16}" + "".join(f"{measure(name, n):>14.2f}" for n in SIZES))


if __name__ == "__main__":
    main()

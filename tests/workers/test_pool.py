from __future__ import annotations

from dataclasses import dataclass

from app.workers.pool import WorkerPool
from app.workers.worker import WorkerState

MODEL = "moonshotai/Kimi-K2.5"


@dataclass(frozen=True)
class Ep:
    name: str
    url: str
    draining: bool = False


def test_available_is_healthy_workers_serving_the_model() -> None:
    pool = WorkerPool(["http://a:1", "http://b:1", "http://c:1"])
    a, b, c = pool.workers
    for w in (a, b, c):
        pool.set_models(w, [{"id": MODEL, "max_model_len": 8}])
    a.state = b.state = WorkerState.HEALTHY
    b.models = ("other",)
    assert pool.available(MODEL) == [a]
    assert pool.served_models() == [MODEL, "other"]
    assert pool.card(MODEL)["max_model_len"] == 8


def test_reconcile_adds_drains_and_removes() -> None:
    pool = WorkerPool()
    pool.reconcile([Ep("pod-a", "http://10.0.0.1:30000"), Ep("pod-b", "http://10.0.0.2:30000")])
    a = pool.get("pod-a")
    b = pool.get("pod-b")
    assert a is not None and b is not None and a.state is WorkerState.STARTING
    a.state = WorkerState.HEALTHY
    b.in_flight = 1
    pool.reconcile([Ep("pod-a", "http://10.0.0.1:30000", draining=True)])
    assert a.state is WorkerState.DRAINING
    assert pool.get("pod-b") is b and b.state is WorkerState.DRAINING  # busy: kept, drained
    b.in_flight = 0
    pool.reconcile([Ep("pod-a", "http://10.0.0.1:30000")])
    assert pool.get("pod-b") is None
    assert a.state is WorkerState.STARTING  # back from draining: health decides again

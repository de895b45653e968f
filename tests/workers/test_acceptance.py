"""Acceptance-collapse detection from per-request samples, de-weighting in admission, and the
fleet saturation figure."""

from __future__ import annotations

import pytest

from app.routing.config import RoutingConfig
from app.workers.acceptance import CollapseDetector
from app.workers.admission import Admission
from app.workers.config import AdmissionConfig
from app.workers.worker import Worker, WorkerLoad, WorkerState


def _fleet(n: int) -> list[Worker]:
    return [Worker(url=f"http://10.0.0.{i}:30000", state=WorkerState.HEALTHY) for i in range(n)]


def _detector(workers: list[Worker], **config: float) -> CollapseDetector:
    settings = {"collapse_min_samples": 5, "collapse_ewma_alpha": 0.2, **config}
    return CollapseDetector(RoutingConfig(**settings), lambda: workers)  # type: ignore[arg-type]


def _feed(detector: CollapseDetector, worker: Worker, value: float, n: int) -> None:
    for _ in range(n):
        detector.observe(worker, value)


def test_only_the_worker_far_below_its_peers_is_flagged() -> None:
    fleet = _fleet(4)
    detector = _detector(fleet)
    for worker, value in zip(fleet, (3.7, 4.5, 5.3, 1.3), strict=True):
        _feed(detector, worker, value, 10)
    assert [w.accept.collapsed for w in fleet] == [False, False, False, True]
    assert fleet[3].accept.ewma == pytest.approx(1.3)


def test_nothing_is_judged_before_enough_samples_or_without_a_peer() -> None:
    fleet = _fleet(3)
    detector = _detector(fleet)
    _feed(detector, fleet[0], 4.5, 10)
    _feed(detector, fleet[1], 1.3, 10)
    _feed(detector, fleet[2], 4.5, 4)  # not yet a peer, not yet judged
    assert [w.accept.collapsed for w in fleet] == [False, True, False]
    alone = _fleet(1)
    solo = _detector(alone)
    _feed(solo, alone[0], 1.2, 50)
    assert not alone[0].accept.collapsed  # nothing to compare with


def test_a_fleet_wide_change_of_traffic_flags_nobody() -> None:
    fleet = _fleet(3)
    detector = _detector(fleet)
    for worker in fleet:
        _feed(detector, worker, 5.5, 10)
    for worker in fleet:  # everyone now serves chat: lower, but together
        _feed(detector, worker, 2.0, 10)
    assert not any(w.accept.collapsed for w in fleet)


def test_hysteresis_between_the_collapse_and_clear_ratios() -> None:
    fleet = _fleet(3)
    detector = _detector(fleet, collapse_ratio=0.6, collapse_clear_ratio=0.8, collapse_ewma_alpha=1)
    _feed(detector, fleet[0], 5.0, 5)
    _feed(detector, fleet[1], 5.0, 5)
    _feed(detector, fleet[2], 2.9, 5)  # 0.58 x the median 5.0
    assert fleet[2].accept.collapsed
    detector.observe(fleet[2], 3.5)  # 0.7 x: above the collapse ratio, below the clear ratio
    assert fleet[2].accept.collapsed
    detector.observe(fleet[2], 4.1)  # 0.82 x: clear
    assert not fleet[2].accept.collapsed
    detector.observe(fleet[2], 3.5)  # 0.7 x again: stays clear until below 0.6 x
    assert not fleet[2].accept.collapsed


def test_reset_forgets_the_samples_and_the_flag() -> None:
    fleet = _fleet(2)
    detector = _detector(fleet)
    _feed(detector, fleet[0], 4.0, 5)
    _feed(detector, fleet[1], 1.3, 5)
    assert fleet[1].accept.collapsed
    fleet[1].accept.reset()
    assert (fleet[1].accept.ewma, fleet[1].accept.samples, fleet[1].accept.collapsed) == (
        None,
        0,
        False,
    )


def test_clear_ratio_below_collapse_ratio_is_refused() -> None:
    with pytest.raises(ValueError, match="collapse_clear_ratio"):
        RoutingConfig(collapse_ratio=0.6, collapse_clear_ratio=0.5)


def _admission(deweight: bool) -> Admission:
    config = AdmissionConfig(per_worker_cap=2, queue_size=2, queue_timeout_s=5.0)
    return Admission(config, deweight_collapsed=deweight)


@pytest.mark.parametrize("deweight", [False, True])
def test_a_collapsed_worker_gets_requests_only_when_its_peers_are_full(deweight: bool) -> None:
    fleet = _fleet(3)
    fleet[2].accept.collapsed = True
    admission = _admission(deweight)
    ready = admission.with_room(fleet)
    assert (fleet[2] in ready) is not deweight
    fleet[0].in_flight = fleet[1].in_flight = 2  # the healthy peers are at their cap
    assert admission.with_room(fleet) == [fleet[2]]


def test_fleet_saturation_is_demand_over_the_routable_caps() -> None:
    fleet = _fleet(3)
    admission = _admission(False)
    assert admission.saturation(fleet) == 0.0
    fleet[0].in_flight = 2
    fleet[1].load = WorkerLoad(running=1, waiting=2)  # other replicas' requests count too
    fleet[2].state = WorkerState.UNHEALTHY  # neither its cap nor its requests count
    fleet[2].in_flight = 2
    assert admission.saturation(fleet) == 1.0  # demand 5 over 4 slots: every slot taken
    fleet[1].load = WorkerLoad(running=1)
    assert admission.saturation(fleet) == pytest.approx(3 / 4)
    fleet[0].state = fleet[1].state = WorkerState.UNHEALTHY
    assert admission.saturation(fleet) == 0.0


def test_fleet_saturation_stays_within_0_and_1_whatever_a_worker_reports() -> None:
    fleet = _fleet(2)
    admission = _admission(False)
    fleet[0].load = WorkerLoad(running=-(10**18), waiting=-(10**18))
    assert admission.saturation(fleet) == 0.0
    fleet[1].in_flight = 1
    assert admission.saturation(fleet) == pytest.approx(1 / 4)
    fleet[0].load = WorkerLoad(running=10**300)
    assert admission.saturation(fleet) == 1.0

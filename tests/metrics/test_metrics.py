"""The metric set in process: what one request records, acceptance length exact and estimated,
the optional per-request figure for clients, worker gauges from the pool, bounded labels."""

from __future__ import annotations

import itertools
import random
import uuid
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import INTER_CHUNK_BUCKETS, MAX_MODELS, Metrics, TokenWindow, observe_gaps
from app.surfaces import ROUTES
from app.upstream.sse import SSEObserver
from app.workers.worker import WorkerLoad
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, chat_chunks, sse

CHAT = "/v1/chat/completions"
META = {"spec_verify_ct": 2, "spec_accept_length": 1.5, "completion_tokens": 3}


def meta_worker() -> FakeWorker:
    """Answers ``return_meta_info`` like SGLang: ``meta_info`` inside each choice."""
    return FakeWorker(meta_info=META)


def chat(**extra: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v for (n, lbls), v in series(text).items() if n == name and set(labels.items()) <= set(lbls)
    )


async def scrape(gw: GatewayHarness) -> str:
    return (await gw.request("GET", "/metrics")).body.decode()


async def test_non_streamed_chat_is_exact_and_meta_info_is_stripped() -> None:
    worker = meta_worker()
    async with GatewayHarness([worker]) as gw:
        plain = await gw.post(CHAT, chat())
        asked = await gw.post(CHAT, chat(return_meta_info=True))
        text = await scrape(gw)
    assert [r["return_meta_info"] for r in worker.requests] == [True, True]
    assert "meta_info" not in plain.json()["choices"][0]
    assert plain.json()["choices"][0]["message"]["content"] == "Hello!"
    assert int(plain.headers["content-length"]) == len(plain.body)
    assert asked.json()["choices"][0]["meta_info"] == META
    assert "x-dflash-accept-length" not in plain.headers  # off by default
    assert value(text, "dflash_gateway_spec_verify_steps_total", worker=worker.name) == 4
    assert value(text, "dflash_gateway_completion_tokens_total", model=MODEL) == 6
    assert value(text, "dflash_gateway_prompt_tokens_total", model=MODEL) == 14
    assert value(text, "dflash_gateway_spec_accept_length_sum", source="exact") == 3.0
    assert value(text, "dflash_gateway_spec_accept_length_count", source="exact") == 2
    assert value(text, "dflash_gateway_spec_accept_length_count", source="estimated") == 0
    bucket = {"source": "exact", "le": "1.5"}
    assert value(text, "dflash_gateway_spec_accept_length_bucket", **bucket) == 2


async def test_exposed_accept_length_header_on_non_streamed() -> None:
    async with GatewayHarness([meta_worker()], expose_accept_length=True) as gw:
        ex = await gw.post(CHAT, chat())
    assert ex.headers["x-dflash-accept-length"] == "1.5000"


async def test_stream_is_estimated_from_its_chunks() -> None:
    worker = FakeWorker(texts=("a", "b", "c", "d", "e", "f"))
    async with GatewayHarness([worker]) as gw:
        ex = await gw.post(CHAT, chat(stream=True, stream_options={"include_usage": True}))
        text = await scrape(gw)
    # Relayed unchanged: the per-request figure is off by default.
    assert ex.body == b"".join(chat_chunks(worker.requests[0]["rid"], worker.texts))
    # role + 6 steps + finish + usage + [DONE]; completion_tokens = 6 -> 6 verify steps.
    assert value(text, "dflash_gateway_spec_verify_steps_total") == 6
    assert value(text, "dflash_gateway_spec_accept_length_sum", source="estimated") == 1.0
    assert value(text, "dflash_gateway_completion_tokens_total") == 6
    assert value(text, "dflash_gateway_time_to_first_token_seconds_count") == 1
    assert value(text, "dflash_gateway_inter_chunk_seconds_count") == 9  # the chunks after the 1st
    assert value(text, "dflash_gateway_time_per_output_token_seconds_count") == 1
    assert value(text, "dflash_gateway_stream_outcomes_total", outcome="ok") == 1
    assert value(text, "dflash_gateway_request_duration_seconds_count", route=CHAT) == 1
    assert value(text, "dflash_gateway_queue_wait_seconds_count") == 1


async def test_exposed_accept_length_on_the_usage_chunk_the_client_asked_for() -> None:
    worker = FakeWorker(texts=("a", "b", "c", "d"))
    async with GatewayHarness([worker], expose_accept_length=True) as gw:
        asked = await gw.post(CHAT, chat(stream=True, stream_options={"include_usage": True}))
        forced = await gw.post(CHAT, chat(stream=True))
    upstream = chat_chunks(worker.requests[0]["rid"], worker.texts)
    chunks = [e + b"\n\n" for e in asked.body.split(b"\n\n") if e]
    # Every chunk but the usage chunk is the worker's; that one gains one field, first.
    assert chunks[:-2] == upstream[:-2] and chunks[-1] == upstream[-1]
    usage = orjson.loads(chunks[-2][6:])["usage"]
    assert usage == {"spec_accept_length": 1.0, **orjson.loads(upstream[-2][6:])["usage"]}
    assert next(iter(usage)) == "spec_accept_length"
    # A usage chunk the gateway forced is still dropped: no field appears anywhere.
    assert b"spec_accept_length" not in forced.body and b'"usage"' not in forced.body


def test_estimate_does_not_depend_on_how_reads_are_cut() -> None:
    rid = "r" * 32
    stream = b"".join(chat_chunks(rid, ["x"] * 7))
    for size in (1, 13, 200, len(stream)):
        obs = SSEObserver(drop_usage=False, overhead=2)
        for i in range(0, len(stream), size):
            obs.feed(stream[i : i + size])
        obs.finish()
        assert obs.usage is not None and obs.usage.verify_steps == 7, size
        assert obs.done


def test_text_completion_streams_carry_the_finish_on_the_last_step() -> None:
    base = {"id": "r", "object": "text_completion", "model": MODEL}
    steps = [{"text": t, "finish_reason": f} for t, f in (("a", None), ("b", None), ("c", "stop"))]
    stream = [sse({**base, "choices": [{"index": 0, **s}]}) for s in steps]
    stream.append(sse({**base, "choices": [], "usage": {"completion_tokens": 9}}))
    obs = SSEObserver(drop_usage=True, overhead=0)
    for chunk in [*stream, b"data: [DONE]\n\n"]:
        obs.feed(chunk)
    assert obs.usage is not None and obs.usage.verify_steps == 3
    assert obs.usage.accept_length == 3.0


def test_bulk_gap_observation_equals_one_observe_per_gap() -> None:
    rng = random.Random(5)
    times = [0.0]
    for _ in range(500):
        times.append(times[-1] + rng.choice([0.0, 0.001, 0.05, 0.1, rng.expovariate(20), 40.0]))
    one, bulk = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("gap_seconds", "d", ["m"], buckets=INTER_CHUNK_BUCKETS, registry=one)
    h2 = Histogram("gap_seconds", "d", ["m"], buckets=INTER_CHUNK_BUCKETS, registry=bulk)
    for a, b in itertools.pairwise(times):
        h1.labels("x").observe(b - a)
    observe_gaps(h2.labels("x"), times[0], times[1:])
    assert series(generate_latest(bulk).decode()) == pytest.approx(
        series(generate_latest(one).decode())
    )


def test_token_window_is_tokens_per_second_over_the_window() -> None:
    window = TokenWindow(10)
    window.add(100.2, 50)
    window.add(105.9, 50)
    assert window.rate(106.0) == 10.0
    assert window.rate(110.5) == 10.0
    assert window.rate(115.5) == 5.0  # the first second left the window
    assert window.rate(200.0) == 0.0


def test_model_labels_are_bounded() -> None:
    metrics = Metrics(models=[MODEL], routes=ROUTES)
    for i in range(MAX_MODELS * 3):
        metrics.record_request("/v1/chat/completions", f"model-{i}", 200)
    text = metrics.render().decode()
    models = {
        dict(lbls).get("model")
        for (name, lbls), _ in series(text).items()
        if name == "dflash_gateway_requests_total"
    }
    assert len(models) == MAX_MODELS + 1 and "other" in models and MODEL in models
    assert value(text, "dflash_gateway_requests_total", model="other") == MAX_MODELS * 3 - (
        MAX_MODELS - 1
    )


async def test_worker_gauges_come_from_the_pool_when_scraped() -> None:
    workers = [FakeWorker(), FakeWorker()]
    async with GatewayHarness(workers) as gw:
        first = await scrape(gw)
        pool = gw.gateway.pool
        one = pool.get(workers[0].name)
        one.load = WorkerLoad(gen_throughput=812.5, accept_length=4.25, accept_rate=0.46)
        for _ in range(5):
            one.breaker.on_failure()
        second = await scrape(gw)
        pool.reconcile([e for e in _endpoints(pool) if e.name != workers[1].name])
        third = await scrape(gw)
    w1 = {"role": "whole", "worker": workers[0].name}  # labels in the exposition's order
    w2 = {"role": "whole", "worker": workers[1].name}
    for w in (w1, w2):
        assert value(first, "dflash_gateway_worker_up", **w) == 1
        assert value(first, "dflash_gateway_worker_breaker_state", **w) == 0
        assert ("dflash_gateway_in_flight_requests", tuple(w.items())) in series(first)
    # Not reported yet: no series (rather than a misleading 0).
    assert not [n for n, _ in series(first) if n == "dflash_gateway_worker_spec_accept_length"]
    assert value(second, "dflash_gateway_worker_up", **w1) == 0  # breaker open
    assert value(second, "dflash_gateway_worker_breaker_state", **w1) == 1
    assert value(second, "dflash_gateway_worker_spec_accept_length", **w1) == 4.25
    assert value(second, "dflash_gateway_worker_spec_accept_rate", **w1) == 0.46
    assert value(second, "dflash_gateway_worker_output_throughput_tokens_per_second", **w1) == 812.5
    # A worker that left: its gauges go, its counters stay.
    left = {name for name, lbls in series(third) if ("worker", workers[1].name) in lbls}
    assert left == {
        "dflash_gateway_upstream_attempts_total",
        "dflash_gateway_upstream_violations_total",
        "dflash_gateway_prompt_tokens_total",
        "dflash_gateway_cached_prompt_tokens_total",
        "dflash_gateway_completion_tokens_total",
        "dflash_gateway_reasoning_tokens_total",
        "dflash_gateway_spec_verify_steps_total",
    }


def _endpoints(pool: Any) -> list[Any]:
    from app.workers.discovery import Endpoint

    return [Endpoint(name=w.name, url=w.url) for w in pool.workers]


async def test_cardinality_stays_bounded_under_hostile_input() -> None:
    """1,000 distinct model names, 1,000 distinct users and random paths add no series."""
    rng = random.Random(11)
    async with GatewayHarness([FakeWorker()]) as gw:
        await gw.post(CHAT, chat())
        await gw.post(CHAT, chat(stream=True))
        await gw.post(CHAT, chat(model="unknown"))  # the 404 series
        before = set(series(await scrape(gw)))
        for i in range(1000):
            await gw.post(CHAT, chat(model=f"model-{uuid.uuid4().hex}"))
            await gw.post(CHAT, chat(user=f"user-{i}-{rng.getrandbits(64)}", stream=i % 2 == 0))
        for _ in range(200):
            path = "/" + "/".join(uuid.uuid4().hex[: rng.randint(1, 12)] for _ in range(3))
            await gw.request(rng.choice(["GET", "POST"]), rng.choice(["/v1", ""]) + path)
        text = await scrape(gw)
    after = set(series(text))
    assert after == before
    assert value(text, "dflash_gateway_requests_total", model="other", status="404") == 1001
    assert value(text, "dflash_gateway_requests_total", model=MODEL, status="200") == 1002


def test_held_updates_equal_one_call_each_at_every_collect() -> None:
    """The record_* calls are held in the process and added at the next collect: a scrape (or
    ``get_sample_value``) shows exactly what one prometheus_client call per update would have,
    bucket edges included, and nothing is added twice."""
    metrics = Metrics(models=[MODEL], routes=[CHAT])
    reference = CollectorRegistry()
    duration = Histogram(
        "dflash_gateway_request_duration_seconds",
        "d",
        ["route", "model"],
        buckets=metrics.request_duration._upper_bounds[:-1],
        registry=reference,
    )
    values = [0.05, 0.1, 0.0, 0.07, 3600.0, 5000.0, 0.25, 0.25000001]  # on, under, over edges
    for value in values:
        metrics.record_request(CHAT, MODEL, 200, value)
        duration.labels(CHAT, MODEL).observe(value)
    got = series(metrics.render().decode())
    want = series(generate_latest(reference).decode())
    for key, value in want.items():
        if key[0].startswith("dflash_gateway_request_duration_seconds"):
            assert got[key] == pytest.approx(value), key
    labels = {"route": CHAT, "model": MODEL, "status": "200"}
    requests = ("dflash_gateway_requests_total", tuple(sorted(labels.items())))
    assert got[requests] == len(values)
    # Collected again with nothing new: the same figures, not added twice.
    assert series(metrics.render().decode())[requests] == len(values)
    metrics.record_request(CHAT, MODEL, 200, 0.1)
    value = metrics.registry.get_sample_value("dflash_gateway_requests_total", labels)
    assert value == len(values) + 1


def test_a_negative_count_is_refused_when_recorded_not_at_the_scrape() -> None:
    metrics = Metrics(models=[MODEL], routes=[CHAT])
    with pytest.raises(ValueError, match="non-negative"):
        metrics.record_tokens(
            MODEL, "w", prompt=-3, completion=None, reasoning=None, verify_steps=None, source=None
        )
    metrics.render()  # the scrape still works

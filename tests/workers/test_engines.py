"""The vLLM engine's reading of a Prometheus exposition (counters as rates over polls, hostile
values ignored, a restart survived) and the engine-naming worker URLs."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.workers.engines import VLLMEngine, parse_vllm_metrics, split_engine_url
from app.workers.worker import Worker

LABELS = '{engine="0",model_name="moonshotai/Kimi-K2.5"}'


def exposition(running: float, generated: float, drafts: float, accepted: float) -> bytes:
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{LABELS} {running}",
        f"vllm:num_requests_waiting{LABELS} 2.0",
        f"vllm:kv_cache_usage_perc{LABELS} 0.25",
        f"vllm:generation_tokens_total{LABELS} {generated}",
        f"vllm:spec_decode_num_drafts_total{LABELS} {drafts}",
        f"vllm:spec_decode_num_draft_tokens_total{LABELS} {drafts * 7}",
        f"vllm:spec_decode_num_accepted_tokens_total{LABELS} {accepted}",
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="0"}} {drafts}',
    ]
    return "\n".join(lines).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rates_between_polls_give_throughput_and_acceptance() -> None:
    clock = Clock()
    engine = VLLMEngine(256, clock)
    first = engine.load_from(parse_vllm_metrics(exposition(0, 0, 0, 0)))
    assert first is not None and first.accept_length is None
    clock.now += 2.0
    load = engine.load_from(parse_vllm_metrics(exposition(4, 600, 200, 400)))
    assert load is not None
    assert (load.running, load.waiting, load.token_usage) == (4, 2, 0.25)
    assert load.gen_throughput == pytest.approx(300.0)
    assert load.accept_length == pytest.approx(3.0)  # 1 + 400 / 200
    assert load.accept_rate == pytest.approx(400 / 1400)
    assert load.max_running_requests == 256  # not reported: the setting
    # Idle: no new drafts, the acceptance stands; throughput falls to 0.
    clock.now += 2.0
    idle = engine.load_from(parse_vllm_metrics(exposition(0, 600, 200, 400)))
    assert idle is not None and idle.gen_throughput == 0 and idle.accept_length == 3.0


def test_a_restarted_server_counters_do_not_give_negative_rates() -> None:
    clock = Clock()
    engine = VLLMEngine(256, clock)
    engine.load_from(parse_vllm_metrics(exposition(1, 0, 0, 0)))
    clock.now += 1.0
    engine.load_from(parse_vllm_metrics(exposition(1, 5000, 1000, 2000)))
    clock.now += 1.0
    after = engine.load_from(parse_vllm_metrics(exposition(1, 10, 5, 10)))
    assert after is not None and after.gen_throughput == 0 and after.accept_length == 3.0
    clock.now += 1.0
    later = engine.load_from(parse_vllm_metrics(exposition(1, 110, 15, 50)))
    assert later is not None and later.accept_length == pytest.approx(1 + 40 / 10)


def test_hostile_values_are_not_read() -> None:
    text = (
        f"vllm:num_requests_running{LABELS} NaN\n"
        f"vllm:num_requests_waiting{LABELS} -5\n"
        f"vllm:kv_cache_usage_perc{LABELS} 1e300\n"
        f"vllm:generation_tokens_total{LABELS} +Inf\n"
        "vllm:num_requests_running{broken 3\n"
    ).encode()
    assert parse_vllm_metrics(text) == {}
    assert VLLMEngine(8).load_from(parse_vllm_metrics(text)) is None  # no running: not vLLM's


def test_an_engine_named_in_the_url_is_pinned_and_stripped() -> None:
    assert split_engine_url("vllm+http://10.0.0.1:8000") == ("vllm", "http://10.0.0.1:8000")
    assert split_engine_url("http://10.0.0.1:8000") == (None, "http://10.0.0.1:8000")
    worker = Worker("vllm+http://10.0.0.1:8000/")
    assert (worker.url, worker.name, worker.engine_pin) == (
        "http://10.0.0.1:8000",
        "10.0.0.1:8000",
        "vllm",
    )
    assert worker.engine_name == "vllm"
    settings = Settings(worker_urls=["vllm+http://a:8000", "sglang+http://b:30000"])
    assert settings.worker_urls == ["vllm+http://a:8000", "sglang+http://b:30000"]
    with pytest.raises(ValidationError, match="must start with"):
        Settings(worker_urls=["tgi+http://a:8000"])

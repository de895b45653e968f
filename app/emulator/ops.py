"""SGLang's operational endpoints: health, models, server and model info, loads, abort, flush,
metrics."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from app.emulator import render
from app.emulator.asgi import TEXT, Receive, Scope, Send, query, read_body, respond, respond_json
from app.emulator.worker import CONTEXT_LEN, SGLANG_VERSION, EmulatedWorker

_VALID_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


async def health(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``/health`` and ``/health_generate``: empty body; 503 while warming up or unhealthy."""
    status = 503 if worker.warming_up or worker.faults.unhealthy else 200
    await respond(send, status, b"", content_type=None)


async def ready(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``/ready``: 503 until warmed up (the unhealthy fault does not change readiness)."""
    await respond(send, 503 if worker.warming_up else 200, b"", content_type=None)


def _card(worker: EmulatedWorker, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(worker.clock.time()),
        "owned_by": "vllm" if worker.config.vllm else "sglang",
        "root": name,
        "parent": None,
        "max_model_len": CONTEXT_LEN,
    }


async def models(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    await respond_json(send, 200, {"object": "list", "data": [_card(worker, worker.config.model)]})


async def model_card(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/models/{model}``: the card, or SGLang's OpenAI-style 404."""
    name = scope["path"][len("/v1/models/") :]
    if name != worker.config.model:
        error = {
            "message": f"The model '{name}' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        await respond_json(send, 404, {"error": error})
        return
    await respond_json(send, 200, _card(worker, name))


def server_args(worker: EmulatedWorker) -> dict[str, Any]:
    c = worker.config
    return {
        "model_path": c.model,
        "served_model_name": c.model,
        "tokenizer_path": c.model,
        "host": c.host,
        "port": c.port,
        "tp_size": 8,
        "pp_size": 1,
        "dp_size": 1,
        "context_length": CONTEXT_LEN,
        "max_running_requests": c.max_running_requests,
        "max_queued_requests": c.max_queued_requests,
        "schedule_policy": "fcfs",
        "enable_priority_scheduling": c.enable_priority_scheduling,
        "abort_on_priority_when_disabled": c.abort_on_priority_when_disabled,
        "schedule_low_priority_values_first": False,
        "max_total_tokens": c.max_total_tokens,
        "page_size": c.page_size,
        "kv_events_config": c.kv_events_config,
        "mem_fraction_static": 0.9,
        "attention_backend": "trtllm_mla",
        "speculative_algorithm": "DFLASH",
        "speculative_draft_model_path": "z-lab/Kimi-K2.5-DFlash",
        "speculative_num_draft_tokens": 8,
        "speculative_draft_window_size": 4096,
        "speculative_draft_attention_backend": "fa4",
        "reasoning_parser": "kimi_k2",
        "tool_call_parser": "kimi_k2",
        "enable_metrics": True,
        "enable_cache_report": c.enable_cache_report,
        "trust_remote_code": True,
        "weight_version": "default",
        "disaggregation_mode": c.disagg.mode,
        "disaggregation_transfer_backend": c.disagg.transfer_backend,
        "disaggregation_bootstrap_port": c.disagg.bootstrap_port,
        "disaggregation_decode_allocation_policy": "early",
    }


async def server_info(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    worker.window.roll()
    c = worker.config
    state = {
        "avg_spec_accept_length": worker.avg_accept_length,
        "last_gen_throughput": worker.window.throughput,
        "num_running_reqs": worker.running,
        "num_waiting_reqs": worker.waiting,
        "effective_max_running_requests_per_dp": c.max_running_requests,
        "memory_usage": {"token_capacity": c.max_total_tokens, "token_capacity_swa": None},
    }
    info = {
        **server_args(worker),
        # The scheduler's handshake (``scheduler.py`` ``get_init_info``): the pool's real size.
        "status": "ready",
        "max_total_num_tokens": c.max_total_tokens,
        "max_req_input_len": min(CONTEXT_LEN, c.max_total_tokens) - 1,
        "kv_events": worker.kv_events.describe(c.page_size),
        "startup_time": worker.started,
        "internal_states": [state],
        "version": SGLANG_VERSION,
        "frontend": "python",
    }
    await respond_json(send, 200, info)


async def model_info(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    c = worker.config
    info = {
        "model_path": c.model,
        "served_model_name": c.model,
        "tokenizer_path": c.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": "kimi_k2",
        "tool_call_parser": "kimi_k2",
        "disaggregation_mode": c.disagg.mode,
        "has_image_understanding": True,
        "has_audio_understanding": False,
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
    }
    await respond_json(send, 200, info)


async def loads(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    include_raw = query(scope).get("include")
    include = {s.strip() for s in include_raw.split(",")} if include_raw else None
    if include is not None and not include <= _VALID_SECTIONS:
        message = (
            f"Invalid include sections: {include - _VALID_SECTIONS}. "
            f"Valid options: {sorted(_VALID_SECTIONS)}"
        )
        await respond_json(send, 400, render.error_body(message, "400", 400))
        return
    s = worker.scheduler
    used = worker.running_tokens
    capacity = worker.config.max_total_tokens
    worker.window.roll()
    load: dict[str, Any] = {
        "timestamp": worker.clock.time(),
        "dp_rank": 0,
        "num_running_reqs": worker.running,
        "num_waiting_reqs": worker.waiting,
        "num_waiting_uncached_tokens": worker.prefill.waiting_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "num_active_tokens": used,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": s.max_running,
        # SGLang's pool usage: tokens held by running requests (cached pages they lock
        # included), not the evictable cache (``pool_stats_observer.py``).
        "token_usage": round(min(1.0, used / capacity), 4),
        "gen_throughput": worker.window.throughput,
        "cache_hit_rate": round(worker.cache.hit_rate, 4),
        "utilization": s.running / s.max_running,
        "total_prefill_uncached_tokens": 0,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }
    if include is None or "all" in include or "spec" in include:
        length = worker.avg_accept_length
        load["speculative"] = {
            "accept_length": length,
            "accept_rate": max(0.0, (length - 1) / 7) if length else 0.0,
        }
    side = worker.disagg
    if side is not None and (include is None or "all" in include or "disagg" in include):
        load["disaggregation"] = side.loads()
    body = {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": None,
        "num_accelerators": 8,
        "loads": [load],
    }
    await respond_json(send, 200, body)


async def abort_request(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    """Abort every running or waiting request whose rid starts with ``rid`` (SGLang matches by
    prefix); ``abort_all`` aborts everything. Always 200 with an empty body."""
    try:
        body = orjson.loads(await read_body(receive) or b"{}")
    except ValueError as exc:
        await respond_json(send, 400, render.error_body(str(exc), "BadRequestError", 400))
        return
    if not isinstance(body, dict):
        body = {}
    rid = body.get("rid") or ""
    worker.scheduler.abort(str(rid), bool(body.get("abort_all", False)))
    await respond(send, 200, b"", content_type=None)


async def flush_cache(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    s = worker.scheduler
    if s.running or s.waiting:
        message = (
            "Cache not flushed: there are running or waiting requests "
            f"(running={s.running}, waiting={s.waiting}).\n"
        )
        await respond(send, 400, message.encode(), content_type=TEXT)
        return
    worker.cache.flush()
    message = (
        "Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)\n"
    )
    await respond(send, 200, message.encode(), content_type=TEXT)


async def metrics(worker: EmulatedWorker, scope: Scope, receive: Receive, send: Send) -> None:
    worker.refresh_metrics()
    await respond(send, 200, worker.metrics.render(), content_type=CONTENT_TYPE_LATEST.encode())

"""The emulator as a vLLM DFlash server (``dflash-gateway emulate --engine vllm``).

Same scheduler, timing and calibrated DFlash acceptance model as the SGLang emulation; what
differs is what vLLM's OpenAI server shows a client and an operator:

* routes: ``/health`` (empty 200), ``/version``, ``/v1/models`` (``owned_by: vllm``),
  ``/metrics`` with ``vllm:`` series, and with ``--vllm-dev-mode`` (vLLM's
  ``VLLM_SERVER_DEV_MODE=1``) ``/server_info?config_format=json``
  (``vllm_config.scheduler_config.max_num_seqs``: the emulator's ``--max-num-seqs``); no
  ``/v1/loads``, ``/abort_request``, ``/model_info`` or ``/flush_cache`` (404). A request is
  aborted when its client disconnects, as vLLM does.
* responses (``app.emulator.render`` with ``vllm=True``): deltas carry only the fields set,
  reasoning as ``reasoning``, ``stop_reason`` instead of ``matched_stop``, no ``meta_info`` and
  no ``metadata``; usage without ``reasoning_tokens``.
* metrics: vLLM's names (``vllm/v1/metrics/loggers.py``) with ``model_name`` and ``engine``
  labels. Each verify step is one draft of ``NUM_SPECULATIVE_TOKENS`` tokens of which the step's
  tokens less the bonus token were accepted (positions 0.. of the per-position counter), so
  ``1 + accepted / drafts`` is the emulator's true acceptance length.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.emulator.asgi import Receive, Scope, Send, respond_json

VLLM_VERSION = "0.20.1"
# The DFlash block is 8 tokens: the bonus token and 7 drafted (``num_speculative_tokens``).
NUM_SPECULATIVE_TOKENS = 7
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class VLLMMetrics:
    """``/metrics`` as a vLLM V1 server with one engine core exposes it (the interface of
    ``app.emulator.metrics.EmulatorMetrics``)."""

    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model, "engine": "0"}
        names = ("model_name", "engine")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*names, *extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self.accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ("position",),
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _E2E
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _E2E,
        )
        labels = self._labels
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens):
            metric.labels(**labels)
        for metric in (self.generation_tokens, self.drafts, self.draft_tokens, self.accepted):
            metric.labels(**labels)
        for pos in range(NUM_SPECULATIVE_TOKENS):
            self.accepted_per_pos.labels(**labels, position=str(pos))
        for reason in ("stop", "length", "abort"):
            self.success.labels(**labels, finished_reason=reason)

    def on_steps(self, tokens: int, step_s: float) -> None:
        """One verify step emitted ``tokens``: one draft, ``tokens - 1`` of its tokens accepted."""
        labels = self._labels
        accepted = max(0, min(NUM_SPECULATIVE_TOKENS, tokens - 1))
        self.generation_tokens.labels(**labels).inc(tokens)
        self.drafts.labels(**labels).inc()
        self.draft_tokens.labels(**labels).inc(NUM_SPECULATIVE_TOKENS)
        if accepted:
            self.accepted.labels(**labels).inc(accepted)
            for pos in range(accepted):
                self.accepted_per_pos.labels(**labels, position=str(pos)).inc()
        self.itl.labels(**labels).observe(step_s)

    def on_finish(
        self,
        *,
        stream: bool,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        verify_steps: int,
        e2e_s: float,
        finish_reason: str | None = None,
    ) -> None:
        labels = self._labels
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        reason = finish_reason if finish_reason in ("stop", "length") else "stop"
        self.success.labels(**labels, finished_reason=reason).inc()
        self.e2e.labels(**labels).observe(e2e_s)

    def on_first_token(self, stream: bool, ttft_s: float) -> None:
        self.ttft.labels(**self._labels).observe(ttft_s)

    def on_queued(self, wait_s: float) -> None:
        self.queue.labels(**self._labels).observe(wait_s)

    def on_abort(self) -> None:
        self.success.labels(**self._labels, finished_reason="abort").inc()

    def refresh(
        self,
        *,
        gen_throughput: float,
        accept_length: float,
        running: int,
        waiting: int,
        max_running: int,
        used_tokens: int,
        max_total_tokens: int,
        cache_hit_rate: float,
    ) -> None:
        labels = self._labels
        self.running.labels(**labels).set(running)
        self.waiting.labels(**labels).set(waiting)
        self.kv_usage.labels(**labels).set(min(1.0, used_tokens / max_total_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def to_vllm_delta(delta: dict[str, Any]) -> dict[str, Any]:
    """A delta as vLLM serialises it: only the fields set, reasoning as ``reasoning``; a tool
    call's id, type and name only on its first delta (vLLM's ``DeltaToolCall``), its arguments
    after that."""
    out: dict[str, Any] = {}
    for key, value in delta.items():
        if value is None:
            continue
        if key == "tool_calls":
            value = [_vllm_tool_call(call) for call in value]
        out["reasoning" if key == "reasoning_content" else key] = value
    return out


def _vllm_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = {k: v for k, v in (call.get("function") or {}).items() if v is not None}
    if call.get("id") is None:
        return {"index": call["index"], "function": function}
    return {"id": call["id"], "type": "function", "index": call["index"], "function": function}


def to_vllm_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice as vLLM has it: ``stop_reason`` (the matched stop string, else None) instead of
    SGLang's ``matched_stop``, no ``meta_info``; a message's reasoning as ``reasoning``."""
    out = {k: v for k, v in choice.items() if k not in ("matched_stop", "meta_info")}
    matched = choice.get("matched_stop")
    out["stop_reason"] = matched if isinstance(matched, str) else None
    if "delta" in out:
        out["delta"] = to_vllm_delta(out["delta"])
    message = out.get("message")
    if isinstance(message, dict):
        message = dict(message)
        if "reasoning_content" in message:
            message["reasoning"] = message.pop("reasoning_content")
        message.setdefault("tool_calls", [])
        out["message"] = message
    return out


def to_vllm_usage(use: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``UsageInfo``: no reasoning token counts."""
    if use is None:
        return None
    return {
        k: v for k, v in use.items() if k not in ("reasoning_tokens", "completion_tokens_details")
    }


async def version(worker: Any, scope: Scope, receive: Receive, send: Send) -> None:
    await respond_json(send, 200, {"version": VLLM_VERSION})


async def server_info(worker: Any, scope: Scope, receive: Receive, send: Send) -> None:
    """vLLM's dev-mode ``/server_info`` (JSON config form), the parts a client reads."""
    c = worker.config
    config = {
        "model_config": {"model": c.model, "max_model_len": 262144, "served_model_name": c.model},
        "parallel_config": {"tensor_parallel_size": 8, "data_parallel_size": 1},
        "scheduler_config": {"max_num_seqs": c.max_running_requests},
        "speculative_config": {
            "method": "dflash",
            "model": "z-lab/Kimi-K2.5-DFlash",
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        },
    }
    await respond_json(send, 200, {"vllm_config": config, "vllm_env": {}, "system_env": {}})

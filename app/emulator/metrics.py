"""The worker's ``/metrics`` with SGLang's names, labels and buckets (its own registry).

Scheduler-side metrics (gauges, ``queue_time_seconds``) carry ``model_name, engine_type, tp_rank,
pp_rank, moe_ep_rank``; tokenizer-side counters and histograms carry ``model_name, engine_type``
(plus ``is_streaming`` where SGLang has it). Gauges are refreshed when scraped; throughput and
acceptance come from the worker's last rate window, as SGLang reports its last logging interval.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.0, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50,
    60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
    2000, 2500, 3000,
)  # fmt: skip
_PD_QUEUES = {
    "prefill_bootstrap_queue": "The number of requests in the prefill bootstrap queue.",
    "prefill_inflight_queue": "The number of requests in the prefill inflight queue.",
    "decode_prealloc_queue": "The number of requests in the decode prealloc queue.",
    "decode_transfer_queue": "The number of requests in the decode transfer queue.",
}
_SCHED = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
_TOK = ("model_name", "engine_type")


class EmulatorMetrics:
    def __init__(self, model: str, disaggregation_mode: str = "null") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # ``DisaggregationMode.to_engine_type``: prefill, decode, else unified.
        engine_type = disaggregation_mode if disaggregation_mode != "null" else "unified"
        self._sched = {
            "model_name": model,
            "engine_type": engine_type,
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        self._tok = {"model_name": model, "engine_type": engine_type}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, _SCHED, registry=r)

        self.num_running_reqs = gauge("num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge(
            "num_queue_reqs", "The number of requests in the waiting queue."
        )
        self.gen_throughput = gauge("gen_throughput", "The generation throughput (token/s).")
        self.token_usage = gauge("token_usage", "The token usage.")
        self.cache_hit_rate = gauge("cache_hit_rate", "The prefix cache hit rate.")
        self.utilization = gauge("utilization", "The utilization.")
        self.max_total_num_tokens = gauge(
            "max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        self.spec_accept_length = gauge(
            "spec_accept_length",
            "Mean acceptance length of speculative decoding (accepted drafts + bonus token per "
            "forward).",
        )
        self.spec_accept_rate = gauge(
            "spec_accept_rate",
            "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
        )
        stream = (*_TOK, "is_streaming")
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", stream, registry=r
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", stream, registry=r
        )
        self.spec_verify_calls = Counter(
            "sglang:spec_verify_calls",
            "Number of speculative decoding verification calls.",
            _TOK,
            registry=r,
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            (*_TOK, "cache_source"),
            registry=r,
        )
        self.num_requests = Counter(
            "sglang:num_requests", "Number of requests processed.", stream, registry=r
        )
        self.num_aborted_requests = Counter(
            "sglang:num_aborted_requests", "Number of requests aborted.", _TOK, registry=r
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            stream,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _TOK,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            stream,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "sglang:queue_time_seconds",
            "Histogram of queueing time in seconds.",
            _SCHED,
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        for streaming in ("true", "false"):
            labels = {**self._tok, "is_streaming": streaming}
            for metric in (self.prompt_tokens, self.generation_tokens, self.num_requests):
                metric.labels(**labels)
            self.ttft.labels(**labels)
            self.e2e.labels(**labels)
        self.spec_verify_calls.labels(**self._tok)
        self.num_aborted_requests.labels(**self._tok)
        self.itl.labels(**self._tok)
        self.queue_time.labels(**self._sched)
        for g in (self.num_running_reqs, self.num_queue_reqs, self.gen_throughput):
            g.labels(**self._sched)
        self.pd: dict[str, Gauge] = {}
        self.pd_failed: dict[str, Counter] = {}
        if disaggregation_mode != "null":
            # PD disaggregation (``observability/metrics_collector.py``): queue gauges of both
            # roles and the failure counters, as SGLang registers them on a PD server.
            for queue, doc in _PD_QUEUES.items():
                self.pd[queue] = gauge(f"num_{queue}_reqs", doc)
                self.pd[queue].labels(**self._sched)
            for stage in ("bootstrap", "transfer"):
                self.pd_failed[stage] = Counter(
                    f"sglang:num_{stage}_failed_reqs",
                    f"The number of {stage} failed requests.",
                    _SCHED,
                    registry=r,
                )
                self.pd_failed[stage].labels(**self._sched)

    def on_steps(self, tokens: int, step_s: float) -> None:
        """One verify step emitted ``tokens`` after ``step_s``: SGLang observes one inter-token
        sample per token, so the step's time is spread evenly over its tokens."""
        child = self.itl.labels(**self._tok)
        per_token = step_s / max(1, tokens)
        for _ in range(tokens):
            child.observe(per_token)

    def on_finish(
        self,
        *,
        stream: bool,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        verify_steps: int,
        e2e_s: float,
        finish_reason: str | None = None,  # vLLM counts requests by it; SGLang does not
    ) -> None:
        labels = {**self._tok, "is_streaming": "true" if stream else "false"}
        self.prompt_tokens.labels(**labels).inc(prompt_tokens)
        self.generation_tokens.labels(**labels).inc(completion_tokens)
        if verify_steps:
            self.spec_verify_calls.labels(**self._tok).inc(verify_steps)
        if cached_tokens:
            # Without a per-source breakdown SGLang reports cache_source="total".
            self.cached_tokens.labels(**self._tok, cache_source="total").inc(cached_tokens)
        self.num_requests.labels(**labels).inc()
        self.e2e.labels(**labels).observe(e2e_s)

    def on_first_token(self, stream: bool, ttft_s: float) -> None:
        self.ttft.labels(**self._tok, is_streaming="true" if stream else "false").observe(ttft_s)

    def on_queued(self, wait_s: float) -> None:
        self.queue_time.labels(**self._sched).observe(wait_s)

    def on_transfer_failed(self, stage: str) -> None:
        """A PD request failed its bootstrap (P's wait for D, D's handshake) or its transfer."""
        counter = self.pd_failed.get(stage)
        if counter is not None:
            counter.labels(**self._sched).inc()

    def refresh_disagg(self, loads: dict[str, object]) -> None:
        """The PD queue gauges from the role's ``/v1/loads`` disaggregation section."""
        for queue, gauge in self.pd.items():
            value = loads.get(f"{queue}_reqs", 0)
            gauge.labels(**self._sched).set(value if isinstance(value, int | float) else 0)

    def on_abort(self) -> None:
        self.num_aborted_requests.labels(**self._tok).inc()

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
        s = self._sched
        self.num_running_reqs.labels(**s).set(running)
        self.num_queue_reqs.labels(**s).set(waiting)
        self.gen_throughput.labels(**s).set(gen_throughput)
        self.token_usage.labels(**s).set(min(1.0, used_tokens / max_total_tokens))
        self.cache_hit_rate.labels(**s).set(cache_hit_rate)
        self.utilization.labels(**s).set(running / max_running)
        self.max_total_num_tokens.labels(**s).set(max_total_tokens)
        self.spec_accept_length.labels(**s).set(accept_length)
        self.spec_accept_rate.labels(**s).set(max(0.0, (accept_length - 1) / 7))

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""``EmulatorConfig`` and ``EmulatedWorker``: everything one emulated SGLang DFLASH worker
holds.

Built once by ``create_emulator_app`` and passed explicitly to every handler; nothing lives at
module level. The clock and the root random source are injected here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from app.emulator.cache import DEFAULT_PAGE_SIZE, PrefixCache
from app.emulator.disagg import DisaggConfig
from app.emulator.engine import Clock, RateWindow, Scheduler, SystemClock, Timing
from app.emulator.faults import Faults, Gate
from app.emulator.kv_events import KvEventPublisher, KvEventsConfig
from app.emulator.metrics import EmulatorMetrics
from app.emulator.prefill_batch import DEFAULT_MAX_PREFILL_TOKENS, PrefillBatcher
from app.emulator.profiles import PROFILE_NAMES, AcceptanceModels, step_time_factors
from app.emulator.roles import Side, make_side
from app.emulator.stats import StatsBook
from app.emulator.vllm import VLLMMetrics

DEFAULT_PORT = 30000
DEFAULT_MODEL = "moonshotai/Kimi-K2.5"
CONTEXT_LEN = 262144
DEFAULT_MAX_TOTAL_TOKENS = 1_000_000
SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class EmulatorConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    model: str = DEFAULT_MODEL
    profile: str = "auto"
    speed: float = 1.0
    max_running_requests: int = 48
    max_queued_requests: int | None = None
    warmup_s: float = 0.0
    stats_file: Path | None = None
    replay: bool = False
    replay_tokens: int = 256
    replay_chunk_interval_s: float = 0.0
    step_base_s: float = Timing.step_base_s
    step_per_running_s: float = Timing.step_per_running_s
    prefill_base_s: float = Timing.prefill_base_s
    prefill_per_token_s: float = Timing.prefill_per_token_s
    step_time_scale: float = 1.0
    accept_scale: float = 1.0
    enable_cache_report: bool = True
    # The KV pool's size in tokens (SGLang's --max-total-tokens) and its page size (--page-size):
    # the prefix cache and the running requests share it (``app.emulator.cache``).
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS
    page_size: int = DEFAULT_PAGE_SIZE
    # New prompt tokens per prefill forward pass (SGLang's --max-prefill-tokens; prefill_batch).
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    # SGLang's / vLLM's --kv-events-config (JSON): publish the cache's changes (``kv_events``).
    kv_events_config: str | None = None
    # SGLang's --enable-priority-scheduling / --abort-on-priority-when-disabled (engine.py).
    enable_priority_scheduling: bool = False
    abort_on_priority_when_disabled: bool = False
    api_key: str | None = None
    seed: int | None = None
    # The server it emulates: sglang, or vllm (``app.emulator.vllm``).
    engine: str = "sglang"
    # vLLM with VLLM_SERVER_DEV_MODE=1: its /server_info (max_num_seqs) is served.
    vllm_dev_mode: bool = False
    faults: Faults = field(default_factory=Faults)
    # Prefill/decode disaggregation (``app.emulator.disagg``); mode "null": a whole worker.
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    def __post_init__(self) -> None:
        if self.profile != "auto" and self.profile not in PROFILE_NAMES:
            raise ValueError(f"unknown profile {self.profile!r}; one of auto, {PROFILE_NAMES}")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        if self.step_time_scale <= 0:
            raise ValueError("step_time_scale must be > 0")
        if not 0 < self.accept_scale <= 1:
            raise ValueError("accept_scale must be in (0, 1]")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.max_total_tokens < self.page_size:
            raise ValueError("max_total_tokens must be at least one page")
        if self.kv_events_config is not None:
            KvEventsConfig.parse(self.kv_events_config)
        if self.engine not in ("sglang", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; one of sglang, vllm")
        self.faults.validate()
        self.disagg.validate(self.port)
        if self.disagg.enabled and (self.vllm or self.replay):
            raise ValueError("disaggregation is emulated for SGLang without --replay only")

    @property
    def vllm(self) -> bool:
        return self.engine == "vllm"


class EmulatedWorker:
    """The emulated worker's state, shared by its handlers."""

    def __init__(
        self,
        config: EmulatorConfig,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock: Clock = clock or SystemClock()
        self.rng = rng or random.Random(config.seed)
        self.timing = Timing(
            speed=config.speed,
            step_base_s=config.step_base_s,
            step_per_running_s=config.step_per_running_s,
            prefill_base_s=config.prefill_base_s,
            prefill_per_token_s=config.prefill_per_token_s,
            scale=config.step_time_scale,
        )
        self.prefill = PrefillBatcher(self.timing, config.max_prefill_tokens)
        self.models = AcceptanceModels(config.accept_scale)
        self.step_factors = step_time_factors()
        self.scheduler = Scheduler(
            config.max_running_requests,
            config.max_queued_requests,
            priority_scheduling=config.enable_priority_scheduling,
            abort_on_priority=config.abort_on_priority_when_disabled,
        )
        self.kv_events = KvEventsConfig.parse(config.kv_events_config or "{}")
        self.publisher = (
            KvEventPublisher(self.kv_events, config.engine, config.page_size)
            if self.kv_events.enabled(config.engine)
            else None
        )
        self.cache = PrefixCache(
            config.max_total_tokens,
            config.page_size,
            recorder=self.publisher.publish if self.publisher is not None else None,
        )
        self.faults = Faults(**config.faults.snapshot())
        self.gate = Gate()
        self.stats = StatsBook(config.stats_file)
        self.metrics: EmulatorMetrics | VLLMMetrics = (
            VLLMMetrics(config.model)
            if config.vllm
            else EmulatorMetrics(config.model, config.disagg.mode)
        )
        self.started_mono = self.clock.monotonic()
        self.started = self.clock.time()
        # Cumulative acceptance for /server_info and /v1/loads.
        self.total_tokens = 0
        self.total_steps = 0
        self.running_tokens = 0
        # Of those, the tokens in the running requests' locked cache pages (shared pages once
        # per request): the rest is the KV they hold outside the cache.
        self.cached_running_tokens = 0
        self.window = RateWindow(self.clock)
        # The prefill or decode role's state (rooms, handshakes); None for a whole worker.
        self.disagg: Side | None = make_side(
            config.disagg, self.clock, f"{config.host}:{config.port}"
        )

    @property
    def warming_up(self) -> bool:
        return self.clock.monotonic() - self.started_mono < self.config.warmup_s

    def on_tokens(self, tokens: int, steps: int) -> None:
        self.total_tokens += tokens
        self.total_steps += steps
        self.window.add(tokens, steps)

    @property
    def running(self) -> int:
        """Requests in the decode batch (SGLang's ``num_running_reqs``): holding a slot and
        past their prefill."""
        return self.scheduler.running - self.prefill.requests

    @property
    def waiting(self) -> int:
        """Requests waiting (``num_waiting_reqs``): for a slot, or for their prefill pass."""
        return self.scheduler.waiting + self.prefill.requests

    @property
    def avg_accept_length(self) -> float:
        return self.total_tokens / self.total_steps if self.total_steps else 0.0

    def refresh_metrics(self) -> None:
        s = self.scheduler
        self.window.roll()
        self.metrics.refresh(
            gen_throughput=self.window.throughput,
            accept_length=self.window.accept_length,
            running=self.running,
            waiting=self.waiting,
            max_running=s.max_running,
            used_tokens=self.running_tokens,
            max_total_tokens=self.config.max_total_tokens,
            cache_hit_rate=self.cache.hit_rate,
        )
        if self.disagg is not None and isinstance(self.metrics, EmulatorMetrics):
            self.metrics.refresh_disagg(self.disagg.loads())

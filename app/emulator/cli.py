"""``dflash-gateway emulate``: run one emulated SGLang DFLASH worker under uvicorn.

uvicorn runs with uvloop and httptools, no access log, and a listening socket with TCP_NODELAY
(accepted connections inherit it), so small SSE events go out at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from app.emulator.asgi import ConnectionDrop
from app.emulator.cache import DEFAULT_PAGE_SIZE
from app.emulator.disagg import (
    DEFAULT_BOOTSTRAP_PORT,
    MODES,
    TRANSFER_BACKENDS,
    DisaggConfig,
)
from app.emulator.engine import Timing
from app.emulator.faults import COLLAPSED_ACCEPT_LENGTH, Faults
from app.emulator.prefill_batch import DEFAULT_MAX_PREFILL_TOKENS
from app.emulator.profiles import PROFILE_NAMES
from app.emulator.worker import (
    DEFAULT_MAX_TOTAL_TOKENS,
    DEFAULT_MODEL,
    DEFAULT_PORT,
    EmulatorConfig,
)
from app.sockets import listen


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "emulate",
        help="run an emulated SGLang DFLASH worker",
        description="Run an emulated SGLang worker serving Kimi-K2.5 with DFLASH speculative "
        "decoding: SGLang's HTTP surface, calibrated verify steps, faults and ground truth.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="bind port (default 30000)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"served model (default {DEFAULT_MODEL})")
    p.add_argument(
        "--profile",
        default="auto",
        choices=("auto", *PROFILE_NAMES),
        help="acceptance profile when no X-Emulator-Profile header is sent (default auto: "
        "classify the prompt)",
    )
    p.add_argument(
        "--speed", type=float, default=1.0, help="time scale, higher is faster (default 1.0)"
    )
    latency = p.add_argument_group(
        "latency model (seconds before --speed): step = (base + per_running * running) times "
        "a per-profile factor from the seed's tok/s"
    )
    for flag, default, what in (
        ("--step-base-s", Timing.step_base_s, "step time with nothing else running"),
        ("--step-per-running-s", Timing.step_per_running_s, "added per running request"),
        ("--prefill-base-s", Timing.prefill_base_s, "prefill time of an empty prompt"),
        ("--prefill-per-token-s", Timing.prefill_per_token_s, "per uncached prompt token"),
    ):
        latency.add_argument(flag, type=float, default=default, help=f"{what} (default {default})")
    latency.add_argument(
        "--step-time-scale",
        type=float,
        default=1.0,
        help="this node's slowdown: every verify step and prefill takes F times as long "
        "(a slower GPU or a hot node; default 1.0)",
    )
    p.add_argument(
        "--accept-scale",
        type=float,
        default=1.0,
        help="multiply every profile's acceptance length by F (floor 1): a drafter that no "
        "longer matches its target; 0.28 gives ~1.3 (default 1.0)",
    )
    p.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        type=int,
        default=48,
        help="running cap (default 48; vLLM calls it --max-num-seqs)",
    )
    p.add_argument(
        "--engine",
        choices=("sglang", "vllm"),
        default="sglang",
        help="the server to emulate: SGLang (default) or vLLM (its routes, chunks and metrics)",
    )
    p.add_argument(
        "--vllm-dev-mode",
        action="store_true",
        help="with --engine vllm: serve /server_info (max_num_seqs), as VLLM_SERVER_DEV_MODE=1",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="waiting cap; beyond it 'The request queue is full.' (default unbounded)",
    )
    p.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="serve waiting requests by their 'priority' field, larger first (SGLang's flag); "
        "without it the field is ignored",
    )
    p.add_argument(
        "--abort-on-priority-when-disabled",
        action="store_true",
        help="without priority scheduling, abort (503) a request that carries 'priority'",
    )
    p.add_argument("--warmup-s", type=float, default=0.0, help="/health answers 503 this long")
    p.add_argument("--stats-file", type=Path, default=None, help="append request records (JSONL)")
    p.add_argument("--replay", action="store_true", help="stream pre-rendered chunks (benchmarks)")
    p.add_argument(
        "--replay-tokens", type=int, default=256, help="completion tokens per replayed response"
    )
    p.add_argument(
        "--replay-chunk-interval-s",
        type=float,
        default=0.0,
        help="pause between replayed chunks (default 0: as fast as possible)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the emulator's random source")
    p.add_argument(
        "--enable-cache-report",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report usage.prompt_tokens_details.cached_tokens (default on)",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=DEFAULT_MAX_TOTAL_TOKENS,
        help="KV pool size in tokens, shared by the prefix cache and the running requests; "
        f"the least recently used cached pages go beyond it (default {DEFAULT_MAX_TOTAL_TOKENS})",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help="tokens per KV page: the prefix cache matches and evicts whole pages "
        f"(default {DEFAULT_PAGE_SIZE}, as SGLang sets for trtllm_mla)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_TOKENS,
        help="new prompt tokens per prefill forward pass: waiting prompts are prefilled in "
        "batches of at most this many, one pass at a time (a longer prompt goes alone; "
        f"default {DEFAULT_MAX_PREFILL_TOKENS}, as SGLang)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish the prefix cache's KV events on ZMQ in SGLang's format (vLLM's with "
        '--engine vllm, which also needs "enable_kv_cache_events": true), e.g. '
        '\'{"publisher":"zmq","endpoint":"tcp://*:5557","topic":"kv-events"}\'; '
        '"bind": true binds a concrete address such as 127.0.0.1',
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' like SGLang's --api-key (health, readiness, "
        "metrics and /emulator/* stay open)",
    )
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    pd = p.add_argument_group(
        "prefill/decode disaggregation (SGLang's --disaggregation-* flags; the timeouts are "
        "SGLang's SGLANG_DISAGGREGATION_* environment variables, in seconds, not scaled by "
        "--speed)"
    )
    pd.add_argument(
        "--disaggregation-mode",
        choices=MODES,
        default="null",
        help="prefill: prefill-only server with a bootstrap server; decode: decode-only server "
        "(default null: a whole worker)",
    )
    pd.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=DEFAULT_BOOTSTRAP_PORT,
        help=f"the prefill server's bootstrap port (default {DEFAULT_BOOTSTRAP_PORT})",
    )
    pd.add_argument(
        "--disaggregation-transfer-backend",
        choices=TRANSFER_BACKENDS,
        default="mooncake",
        help="KV transfer backend; every backend but fake runs the emulated handshake "
        "(default mooncake)",
    )
    for flag, env, default, what in (
        (
            "--disaggregation-bootstrap-timeout",
            "BOOTSTRAP_TIMEOUT",
            300.0,
            "a prefill request waits this long for the decode side's destination",
        ),
        (
            "--disaggregation-waiting-timeout",
            "WAITING_TIMEOUT",
            300.0,
            "a decode request waits this long for the transfer",
        ),
        (
            "--disaggregation-heartbeat-interval",
            "HEARTBEAT_INTERVAL",
            5.0,
            "between tries of an unreachable bootstrap server",
        ),
    ):
        pd.add_argument(
            flag,
            type=float,
            default=default,
            help=f"{what} (SGLANG_DISAGGREGATION_{env}; default {default:g})",
        )
    pd.add_argument(
        "--disaggregation-heartbeat-max-failure",
        type=int,
        default=2,
        help="failed tries before a decode server gives up on a bootstrap server's rooms "
        "(SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE; default 2)",
    )
    faults = p.add_argument_group("faults (also settable at run time: POST /emulator/faults)")
    faults.add_argument("--fail-status", type=int, default=None, help="answer with this status")
    faults.add_argument("--fail-ratio", type=float, default=1.0, help="share of requests failed")
    faults.add_argument("--die-after-chunks", type=int, default=None, help="drop after k events")
    faults.add_argument(
        "--die-mode", choices=("connection", "process"), default="connection", help="what dies"
    )
    faults.add_argument("--hang-before-first-byte", action="store_true", help="never answer")
    faults.add_argument("--first-byte-delay-s", type=float, default=0.0, help="delay the start")
    faults.add_argument(
        "--inband-error-after-chunks", type=int, default=None, help="in-band 503 after k events"
    )
    faults.add_argument("--unhealthy", action="store_true", help="/health answers 503")
    faults.add_argument(
        "--accept-collapse",
        type=float,
        nargs="?",
        const=COLLAPSED_ACCEPT_LENGTH,
        default=None,
        metavar="TOKENS_PER_STEP",
        help=f"acceptance collapses to this mean tokens per verify step for every request (a "
        f"drafter that no longer matches the target; alone: {COLLAPSED_ACCEPT_LENGTH})",
    )


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    faults = Faults(
        fail_status=args.fail_status,
        fail_ratio=args.fail_ratio,
        die_after_chunks=args.die_after_chunks,
        die_mode=args.die_mode,
        hang_before_first_byte=args.hang_before_first_byte,
        first_byte_delay_s=args.first_byte_delay_s,
        inband_error_after_chunks=args.inband_error_after_chunks,
        unhealthy=args.unhealthy,
        accept_collapse=args.accept_collapse,
    )
    return EmulatorConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        profile=args.profile,
        speed=args.speed,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        warmup_s=args.warmup_s,
        stats_file=args.stats_file,
        replay=args.replay,
        replay_tokens=args.replay_tokens,
        replay_chunk_interval_s=args.replay_chunk_interval_s,
        enable_cache_report=args.enable_cache_report,
        max_total_tokens=args.max_total_tokens,
        page_size=args.page_size,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_events_config=args.kv_events_config,
        enable_priority_scheduling=args.enable_priority_scheduling,
        abort_on_priority_when_disabled=args.abort_on_priority_when_disabled,
        api_key=args.api_key,
        seed=args.seed,
        step_base_s=args.step_base_s,
        step_per_running_s=args.step_per_running_s,
        prefill_base_s=args.prefill_base_s,
        prefill_per_token_s=args.prefill_per_token_s,
        step_time_scale=args.step_time_scale,
        accept_scale=args.accept_scale,
        engine=args.engine,
        vllm_dev_mode=args.vllm_dev_mode,
        faults=faults,
        disagg=DisaggConfig(
            mode=args.disaggregation_mode,
            bootstrap_port=args.disaggregation_bootstrap_port,
            transfer_backend=args.disaggregation_transfer_backend,
            bootstrap_timeout_s=args.disaggregation_bootstrap_timeout,
            waiting_timeout_s=args.disaggregation_waiting_timeout,
            heartbeat_interval_s=args.disaggregation_heartbeat_interval,
            heartbeat_max_failure=args.disaggregation_heartbeat_max_failure,
        ),
    )


class _DropFilter(logging.Filter):
    """Hide uvicorn's tracebacks for the deliberate mid-stream connection drop and for held
    streams cancelled at shutdown."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, ConnectionDrop | asyncio.CancelledError)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from app.emulator.app import create_emulator_app

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"dflash-gateway emulate: {exc}", flush=True)
        return 2
    try:
        app = create_emulator_app(config)
    except OSError as exc:  # zmq.ZMQError: the KV events endpoint cannot be bound
        print(f"dflash-gateway emulate: KV events: {exc}", flush=True)
        return 1
    logging.getLogger("uvicorn.error").addFilter(_DropFilter())
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            loop="uvloop",
            http="httptools",
            access_log=False,
            log_level=args.log_level,
            lifespan="on",
            timeout_keep_alive=30,
            # On SIGTERM, streams still held (gate, hang fault) are cut after this long.
            timeout_graceful_shutdown=3,
        )
    )
    addresses = [config.port]
    if config.disagg.mode == "prefill":
        addresses.append(config.disagg.bootstrap_port)
    socks = []
    for port in addresses:
        try:
            socks.append(listen(config.host, port))
        except OSError as exc:
            for sock in socks:
                sock.close()
            print(f"dflash-gateway emulate: cannot bind {config.host}:{port}: {exc}", flush=True)
            return 1
    role = "" if config.disagg.mode == "null" else f" ({config.disagg.mode})"
    print(f"emulated SGLang DFLASH worker{role} on http://{config.host}:{config.port}", flush=True)
    if len(socks) > 1:
        print(f"bootstrap server on {config.host}:{config.disagg.bootstrap_port}", flush=True)
    server.run(sockets=socks)
    return 0

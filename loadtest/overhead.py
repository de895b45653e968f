"""``bench overhead``: what the gateway costs, side by side with sglang-router, in one run.

One emulated worker in ``--replay`` mode (pre-rendered chunks, no generation work) is measured
three ways: direct, through dflash-gateway and through sglang-router. Each proxy is pinned to CPU 0
with ``taskset``; the emulator and this load generator share the other CPU. Proxies are measured
one at a time (``--rounds N``: N interleaved times each, summed). Per proxy and scenario:

- throughput (chunks/s for streams, requests/s otherwise);
- added TTFT p50/p99 against the direct run of the same scenario;
- the proxy process's own CPU seconds (utime+stime from /proc, all its threads and child
  processes) per 1,000 relayed chunks or per 1,000 non-streaming requests — the stable figure on
  shared machines, where wall-clock numbers drift.

Scenarios: streaming at saturation, streaming paced (10 ms per chunk, C=32), a fleet's fan-in
(``stream_fanin``: C=800 streams paced at 80 ms per chunk, about what one gateway replica sees in
front of a fleet of DFLASH workers), non-streaming, and non-streaming with every proxy at its
default log level (``non_stream_logged``: the gateway writes its access line per request, as a
gateway started with no settings does; the other scenarios run it at ``warning``, so they leave
the access log out). In every scenario the client keeps its C connections alive, closed loop,
and the worker answers a non-streamed request with Content-Length, as SGLang does.

Streaming scenarios also run Anthropic's Messages API through the same gateway process (target
``gateway-messages``: ``POST /v1/messages``, each worker chunk translated into Anthropic's
events), normalised by the events the client receives (about one per worker chunk: the role,
finish and usage chunks become message_start, message_delta and message_stop, plus a start and
a stop per content block); the table's last lines give its CPU per chunk against
``/v1/chat/completions``'. The same for OpenAI's Responses API (target ``gateway-responses``:
``POST /v1/responses``, each worker chunk translated into typed Responses events: about one
delta event per worker chunk, plus the lifecycle and item events).

PD rows (unless ``--skip-pd``): prefill/decode disaggregation costs the gateway a second upstream
request per client request (the prefill side, read and dropped) and a pair's bookkeeping. Replay
mode has no disaggregation, so two more gateways are measured against generating emulators at
``--pd-speed``: ``gateway-1pool`` in front of one whole worker and ``gateway-pd``
(``--pd-disaggregation``) in front of one prefill and one decode worker (transfer backend
``fake``: the handshake costs the emulators nothing). The table's last lines give gateway-pd's CPU
per chunk against gateway-1pool's, same scenario, same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import orjson

from app.upstream.errors import TransportError
from app.upstream.http1 import Http1Client
from loadtest.processes import PYTHON, ManagedProcess, ProcessManager, free_port
from loadtest.stats import percentile

T = TypeVar("T")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
GATEWAY = "dflash-gateway"
GATEWAY_MESSAGES = "gateway-messages"
RESPONSES = "/v1/responses"
GATEWAY_RESPONSES = "gateway-responses"
GATEWAY_1POOL = "gateway-1pool"
GATEWAY_PD = "gateway-pd"
# A Responses stream ends with one of these events: the answer whole (maybe cut at max tokens),
# or a failure.
_ENDED = (b"event: response.completed", b"event: response.incomplete")
_FAILED = b"event: response.failed"
_TAIL = 1024  # bytes of a stream's end kept: its last events, an error event's included
_ERROR_EVENT = b'data: {"error"'
_STALL_S = 120.0  # a stalled request fails (ReadTimeout) instead of hanging the bench


@dataclass(frozen=True)
class Scenario:
    name: str
    stream: bool
    concurrency: int
    requests: int
    chunk_interval_s: float  # the emulator's pace between chunks (0 = as fast as possible)
    # Gateways at their default log level (their access line per request) rather than at
    # ``warning``; sglang-router is always at its default.
    logged: bool = False


@dataclass
class Measurement:
    scenario: str
    target: str
    ok: int
    failed: int
    chunks: int
    wall_s: float
    ttfts: list[float]
    cpu_s: float | None  # the proxy's CPU; None for the direct run

    @property
    def unit(self) -> int:
        """What CPU is normalised by: chunks for streams, requests otherwise."""
        return self.chunks if self.chunks else self.ok

    def cpu_per_1000(self) -> float | None:
        if self.cpu_s is None or not self.unit:
            return None
        return self.cpu_s / self.unit * 1000

    def ttft(self, q: float) -> float:
        return percentile(sorted(self.ttfts), q)

    def merge(self, other: Measurement) -> Measurement:
        """This target's figures over both runs (another round of the same scenario)."""
        cpu = None if self.cpu_s is None or other.cpu_s is None else self.cpu_s + other.cpu_s
        return Measurement(
            self.scenario,
            self.target,
            self.ok + other.ok,
            self.failed + other.failed,
            self.chunks + other.chunks,
            self.wall_s + other.wall_s,
            self.ttfts + other.ttfts,
            cpu,
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000, help="requests per saturation run")
    p.add_argument("--paced-requests", type=int, default=320)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per replayed response")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fanin-concurrency", type=int, default=800, help="streams held open (fan-in)")
    p.add_argument("--fanin-requests", type=int, default=1600, help="streams per stream_fanin run")
    p.add_argument("--proxy-cpu", type=int, default=0, help="CPU the proxy is pinned to")
    p.add_argument("--load-cpu", type=int, default=1, help="CPU for emulator and load generator")
    p.add_argument("--skip-router", action="store_true", help="do not run sglang-router")
    p.add_argument("--gateway-processes", type=int, default=1)
    p.add_argument(
        "--api-key",
        metavar="NAME:KEY",
        help="configure this one API key on the gateway and send it (the tenant path: key, "
        "limits, tenant policy); sglang-router gets the header too and ignores it",
    )
    p.add_argument(
        "--skip-pd", action="store_true", help="do not measure PD disaggregation (gateway-pd)"
    )
    p.add_argument("--pd-speed", type=float, default=50.0, help="the PD rows' emulators' --speed")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every target this many times, interleaved (direct, gateway, messages, "
        "responses, direct, ...), and sum each target's rounds: a machine's drift during the "
        "run then weighs on every target alike",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"))


SCENARIOS = ("stream_saturation", "stream_paced", "stream_fanin", "non_stream", "non_stream_logged")


def scenario(args: argparse.Namespace, name: str, requests: int | None = None) -> Scenario:
    """The scenario ``name`` (one of ``SCENARIOS``) with the run's sizes; ``requests`` overrides
    how many requests it sends."""
    if name == "stream_saturation":
        return Scenario(name, True, args.concurrency * 2, requests or args.requests, 0.0)
    if name == "stream_paced":
        return Scenario(name, True, args.concurrency, requests or args.paced_requests, 0.010)
    if name == "stream_fanin":
        return Scenario(name, True, args.fanin_concurrency, requests or args.fanin_requests, 0.080)
    if name == "non_stream":
        return Scenario(name, False, args.concurrency, requests or args.requests, 0.0)
    if name == "non_stream_logged":
        return Scenario(name, False, args.concurrency, requests or args.requests, 0.0, True)
    raise ValueError(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    return [scenario(args, name.strip()) for name in args.scenarios.split(",") if name.strip()]


def process_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and all its live descendants (each counts all its threads)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        stats[int(entry)] = fields
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        own = stats.get(current)
        if own is None:
            continue
        # utime, stime (fields 14, 15 of stat; 11, 12 after the command name)
        total += (int(own[11]) + int(own[12])) / CLOCK_TICKS
        todo.extend(children.get(current, []))
    return total


async def _one(
    client: Http1Client,
    address: tuple[str, int],
    request: bytes,
    stream: bool,
    path: str,
) -> tuple[bool, float, int]:
    start = time.perf_counter()
    response = await client.request(*address, request, first_byte_s=_STALL_S, idle_s=_STALL_S)
    try:
        if not stream or response.status_code != 200:
            await response.aread()
            return not stream and response.status_code == 200, time.perf_counter() - start, 0
        ttft = 0.0
        chunks = 0
        tail = b""
        completed = failed = False
        # Cheap on purpose (the load generator shares a CPU with the emulator): count event
        # starts instead of parsing; ``tail`` catches a marker split across two reads.
        async for data in response.aiter_raw():
            if not chunks:
                ttft = time.perf_counter() - start
            joined = tail + data
            chunks += joined.count(b"data: ") - tail.count(b"data: ")
            if path == RESPONSES:  # its last event holds the whole answer: larger than the tail
                completed = completed or _ENDED[0] in joined or _ENDED[1] in joined
                failed = failed or _FAILED in joined
            tail = joined[-_TAIL:]
    finally:
        await response.aclose()
    if path == RESPONSES:
        return completed and not failed, ttft, chunks
    if path == MESSAGES:
        return tail.rstrip().endswith(b'{"type":"message_stop"}'), ttft, chunks
    # A stream that failed after its first chunk still ends with [DONE], after an error event.
    done = tail.rstrip().endswith(b"data: [DONE]") and _ERROR_EVENT not in tail
    chunks -= 1 if done else 0  # [DONE] is not a relayed chunk
    return done, ttft, chunks


async def drive(
    base_url: str,
    scenario: Scenario,
    model: str,
    max_tokens: int,
    path: str = CHAT,
    api_key: str | None = None,
) -> Measurement:
    """``scenario``'s requests against ``base_url``, ``scenario.concurrency`` at a time, each
    connection kept alive. The client is the gateway's own upstream one (llhttp, no per-request
    models): httpx could not keep up with the fan-in scenario's 10,000 chunks/s on the CPU it
    shares with the emulator."""
    prompt = "Summarise the benefits of speculative decoding."
    fields: dict[str, Any] = {"model": model, "stream": scenario.stream}
    if path == RESPONSES:
        fields |= {"input": prompt, "max_output_tokens": max_tokens}
    else:
        fields |= {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body = orjson.dumps(fields)
    url = urlsplit(base_url)
    address = (url.hostname or "127.0.0.1", url.port or 80)
    head = [
        f"POST {path} HTTP/1.1",
        f"host: {url.netloc}",
        "content-type: application/json",
        f"content-length: {len(body)}",
    ]
    if api_key:
        head.append("authorization: Bearer " + api_key.partition(":")[2])
    request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    results: list[tuple[bool, float, int]] = []
    remaining = iter(range(scenario.requests))
    client = Http1Client(connect_s=10.0, keepalive_s=120.0)

    async def loop() -> None:
        for _ in remaining:
            try:
                results.append(await _one(client, address, request, scenario.stream, path))
            except (TransportError, OSError):
                results.append((False, 0.0, 0))

    start = time.perf_counter()
    try:
        await asyncio.gather(*(loop() for _ in range(scenario.concurrency)))
    finally:
        await client.aclose()
    wall = time.perf_counter() - start
    ok = [r for r in results if r[0]]
    return Measurement(
        scenario=scenario.name,
        target="",
        ok=len(ok),
        failed=len(results) - len(ok),
        chunks=sum(r[2] for r in ok),
        wall_s=wall,
        ttfts=[r[1] for r in ok],
        cpu_s=None,
    )


def _pin(cpu: int, argv: Sequence[str]) -> list[str]:
    if shutil.which("taskset") and os.cpu_count() and os.cpu_count() > cpu:  # type: ignore[operator]
        return ["taskset", "-c", str(cpu), *argv]
    return list(argv)


def start_emulator(procs: ProcessManager, scenario: Scenario, load_cpu: int) -> ManagedProcess:
    argv = [
        PYTHON,
        "-m",
        "app",
        "emulate",
        "--port",
        "{port}",
        "--replay",
        "--max-running-requests",
        "4096",
    ]
    if scenario.chunk_interval_s:
        argv += ["--replay-chunk-interval-s", str(scenario.chunk_interval_s)]
    return procs.start(_pin(load_cpu, argv), name=f"emulator-{scenario.name}")


def gateway_env(scenario: Scenario, api_key: str | None = None) -> dict[str, str]:
    """A measured gateway's environment: no admission cap in the way, logging at ``warning``
    unless ``scenario`` is logged (then the gateway's default, ``info``: one access line per
    request), and ``api_key`` configured when given."""
    env = {"DFLASH_GATEWAY_ADMISSION__PER_WORKER_CAP": "4096"}
    if not scenario.logged:
        env["DFLASH_GATEWAY_LOG_LEVEL"] = "warning"
    if api_key:
        env["DFLASH_GATEWAY_API_KEYS"] = api_key
    return env


def start_proxies(
    procs: ProcessManager, emulator: ManagedProcess, args: argparse.Namespace, scenario: Scenario
) -> dict[str, ManagedProcess]:
    proxies = {
        GATEWAY: procs.start(
            _pin(
                args.proxy_cpu,
                [
                    PYTHON,
                    "-m",
                    "app",
                    "serve",
                    "--port",
                    "{port}",
                    "--worker-url",
                    emulator.url,
                    "--processes",
                    str(args.gateway_processes),
                ],
            ),
            name="dflash-gateway",
            ready_path="/readyz",
            ready_status=200,
            env=gateway_env(scenario, args.api_key),
        ),
    }
    if not args.skip_router:
        metrics_port = free_port()
        proxies["sglang-router"] = procs.start(
            _pin(
                args.proxy_cpu,
                [
                    PYTHON,
                    "-m",
                    "sglang_router.launch_router",
                    "--worker-urls",
                    emulator.url,
                    "--policy",
                    "round_robin",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "{port}",
                    "--prometheus-port",
                    str(metrics_port),
                ],
            ),
            name="sglang-router",
            ready_path="/v1/models",
            ready_status=200,
            timeout=60,
        )
    return proxies


def start_pd(
    procs: ProcessManager, scenario: Scenario, args: argparse.Namespace
) -> tuple[dict[str, ManagedProcess], list[ManagedProcess]]:
    """The PD rows' gateways (single-pool and PD) and their generating emulators."""
    emulate = [
        PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", str(args.pd_speed),
        "--max-running-requests", "4096",
    ]  # fmt: skip
    bootstrap = free_port()
    whole = procs.start(_pin(args.load_cpu, emulate), name=f"whole-{scenario.name}")
    fake = ["--disaggregation-transfer-backend", "fake"]
    prefill = procs.start(
        _pin(args.load_cpu, [*emulate, "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", str(bootstrap), *fake]),
        name=f"prefill-{scenario.name}",
    )  # fmt: skip
    decode = procs.start(
        _pin(args.load_cpu, [*emulate, "--disaggregation-mode", "decode", *fake]),
        name=f"decode-{scenario.name}",
    )
    serve = [PYTHON, "-m", "app", "serve", "--port", "{port}"]
    env = gateway_env(scenario)
    gateways = {
        GATEWAY_1POOL: procs.start(
            _pin(args.proxy_cpu, [*serve, "--worker-url", whole.url]),
            name=GATEWAY_1POOL, ready_path="/readyz", ready_status=200, env=env,
        ),
        GATEWAY_PD: procs.start(
            _pin(args.proxy_cpu, [*serve, "--pd-disaggregation",
                                  "--prefill", prefill.url, str(bootstrap),
                                  "--decode", decode.url]),
            name=GATEWAY_PD, ready_path="/readyz", ready_status=200, env=env,
        ),
    }  # fmt: skip
    return gateways, [whole, prefill, decode]


async def measure_all(args: argparse.Namespace, procs: ProcessManager) -> list[Measurement]:
    measurements: list[Measurement] = []
    model = "moonshotai/Kimi-K2.5"
    for scenario in scenarios(args):
        emulator = start_emulator(procs, scenario, args.load_cpu)
        proxies = start_proxies(procs, emulator, args, scenario)
        targets: list[tuple[str, ManagedProcess, ManagedProcess | None, str]]
        targets = [("direct", emulator, None, CHAT)]
        targets += [(n, p, p, CHAT) for n, p in proxies.items()]
        if scenario.stream:  # the same gateway process, serving Anthropic's Messages API
            targets.append((GATEWAY_MESSAGES, proxies[GATEWAY], proxies[GATEWAY], MESSAGES))
            targets.append((GATEWAY_RESPONSES, proxies[GATEWAY], proxies[GATEWAY], RESPONSES))
        pd_emulators: list[ManagedProcess] = []
        if not getattr(args, "skip_pd", True):
            pd_gateways, pd_emulators = start_pd(procs, scenario, args)
            proxies.update(pd_gateways)
            targets += [(n, p, p, CHAT) for n, p in pd_gateways.items()]
        done: dict[str, Measurement] = {}
        for _ in range(max(1, getattr(args, "rounds", 1))):
            for name, target, proxy, path in targets:
                result = await _measure(args, scenario, model, target, proxy, path)
                result.target = name
                done[name] = done[name].merge(result) if name in done else result
        for result in done.values():
            measurements.append(result)
            print(
                f"  {scenario.name:<18} {result.target:<16} ok={result.ok} failed={result.failed}",
                file=sys.stderr,
            )
        for proc in (*proxies.values(), emulator, *pd_emulators):
            proc.stop()
    return measurements


async def _measure(
    args: argparse.Namespace,
    scenario: Scenario,
    model: str,
    target: ManagedProcess,
    proxy: ManagedProcess | None,
    path: str,
) -> Measurement:
    """One warmed-up run of ``scenario`` against ``target``, with ``proxy``'s CPU over it."""
    warm = Scenario(
        scenario.name,
        scenario.stream,
        scenario.concurrency,
        scenario.concurrency * 2,
        scenario.chunk_interval_s,
        scenario.logged,
    )
    await drive(target.url, warm, model, args.max_tokens, path, args.api_key)  # warm-up
    before = process_tree_cpu(proxy.pid) if proxy else 0.0
    result = await drive(target.url, scenario, model, args.max_tokens, path, args.api_key)
    if proxy is not None:
        result.cpu_s = process_tree_cpu(proxy.pid) - before
    return result


def table(measurements: Sequence[Measurement]) -> str:
    header = (
        f"{'scenario':<18} {'target':<16} {'ok':>6} {'fail':>5} {'thrpt/s':>9} "
        f"{'TTFT p50':>9} {'+p50 ms':>8} {'+p99 ms':>8} {'CPU s/1k':>9} {'vs router':>9}"
    )
    lines = [header, "-" * len(header)]
    for scenario in dict.fromkeys(m.scenario for m in measurements):
        rows = [m for m in measurements if m.scenario == scenario]
        direct = next((m for m in rows if m.target == "direct"), None)
        router = next((m for m in rows if m.target == "sglang-router"), None)
        for m in rows:
            rate = (m.chunks if m.chunks else m.ok) / m.wall_s if m.wall_s else 0.0
            added50 = added99 = "-"
            if direct is not None and m is not direct and m.ttfts and direct.ttfts:
                added50 = f"{(m.ttft(50) - direct.ttft(50)) * 1000:.2f}"
                added99 = f"{(m.ttft(99) - direct.ttft(99)) * 1000:.2f}"
            cpu = m.cpu_per_1000()
            ref = router.cpu_per_1000() if router is not None else None
            ratio = f"{cpu / ref:.2f}" if cpu is not None and ref else "-"
            lines.append(
                f"{m.scenario:<18} {m.target:<16} {m.ok:>6} {m.failed:>5} {rate:>9.0f} "
                f"{m.ttft(50) * 1000:>9.2f} {added50:>8} {added99:>8} "
                f"{'-' if cpu is None else f'{cpu:.3f}':>9} {ratio:>9}"
            )
    lines.append(
        "CPU s/1k = proxy CPU seconds per 1,000 relayed chunks (streams) or requests "
        "(non-streaming); vs router = that figure / sglang-router's (lower is better)"
    )
    for target, path in ((GATEWAY_MESSAGES, MESSAGES), (GATEWAY_RESPONSES, RESPONSES)):
        for name, times in messages_vs_chat(measurements, target).items():
            figure = "n/a (under the CPU clock's 10 ms tick)" if times is None else f"{times:.2f}x"
            lines.append(f"{name}: {path} CPU per chunk = {figure} /v1/chat/completions")
    for name, times in pd_vs_single(measurements).items():
        figure = "n/a (under the CPU clock's 10 ms tick)" if times is None else f"{times:.2f}x"
        lines.append(f"{name}: PD disaggregation CPU per chunk = {figure} single-pool")
    return "\n".join(lines)


def pd_vs_single(measurements: Sequence[Measurement]) -> dict[str, float | None]:
    """Per scenario: gateway-pd's CPU per chunk (per request, non-streaming) over
    gateway-1pool's (None when either is too small to measure)."""
    out: dict[str, float | None] = {}
    for m in measurements:
        if m.target != GATEWAY_PD:
            continue
        single = next(
            (c for c in measurements if c.scenario == m.scenario and c.target == GATEWAY_1POOL),
            None,
        )
        mine, theirs = m.cpu_per_1000(), single.cpu_per_1000() if single is not None else None
        out[m.scenario] = mine / theirs if mine is not None and theirs else None
    return out


def messages_vs_chat(
    measurements: Sequence[Measurement], target: str = GATEWAY_MESSAGES
) -> dict[str, float | None]:
    """Per streaming scenario: the gateway's CPU per chunk on another API (``target``: the
    Messages API's by default) over the same figure on /v1/chat/completions (None when either is
    too small to measure)."""
    out: dict[str, float | None] = {}
    for m in measurements:
        if m.target != target:
            continue
        chat = next(
            (c for c in measurements if c.scenario == m.scenario and c.target == GATEWAY), None
        )
        mine, theirs = m.cpu_per_1000(), chat.cpu_per_1000() if chat is not None else None
        out[m.scenario] = mine / theirs if mine is not None and theirs else None
    return out


def main(args: argparse.Namespace) -> int:
    measurements = run_measured(args.load_cpu, "dflash-overhead-", measure_all, args)
    print(table(measurements))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead.json").write_bytes(
        orjson.dumps(
            [
                {
                    **m.__dict__,
                    "ttfts": None,
                    "ttft_p50_s": m.ttft(50),
                    "ttft_p99_s": m.ttft(99),
                    "cpu_s_per_1000": m.cpu_per_1000(),
                }
                for m in measurements
            ],
            option=orjson.OPT_INDENT_2,
        )
    )
    return 0 if all(m.failed == 0 for m in measurements) else 1


def run_measured(
    load_cpu: int,
    prefix: str,
    measure: Callable[[argparse.Namespace, ProcessManager], Coroutine[Any, Any, T]],
    args: argparse.Namespace,
) -> T:
    """``measure(args, procs)`` with this process pinned to ``load_cpu``, every process it started
    stopped afterwards, and their logs printed to stderr when it fails."""
    _raise_open_files()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            with _affinity(load_cpu):
                return asyncio.run(measure(args, procs))
        except Exception:
            for chunk in procs.dump_logs():
                print(chunk, file=sys.stderr)
            raise
        finally:
            procs.stop_all()


def _raise_open_files() -> None:
    """The fan-in scenario holds 800 client connections and as many upstream ones: lift this
    process's soft limit on open files (the processes it starts inherit it) to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 16384 if hard == resource.RLIM_INFINITY else min(hard, 16384)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class _affinity:
    """Pin this process (the load generator) to one CPU for the duration."""

    def __init__(self, cpu: int) -> None:
        self._cpu = cpu
        self._saved: set[int] | None = None

    def __enter__(self) -> None:
        if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > self._cpu:
            self._saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {self._cpu})

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            os.sched_setaffinity(0, self._saved)

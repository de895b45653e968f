"""Chaos run: workers crash under streaming load, and every client request is accounted for.

    python -m loadtest.chaos --duration 300        # `make chaos`; tests/chaos runs 30 s

Starts ``--workers`` emulators (each with ``--stats-file``) and a gateway in front of them (fast
health checks), warms up, then runs ``--concurrency`` clients that stream chat completions
back to back while every ``--kill-every`` seconds one emulator (in turn) is SIGKILLed and, after
``--down`` seconds, restarted on its port. Then it checks, from the clients' side, the gateway's
JSON access log and the emulators' stats files (ground truth that survives SIGKILL):

- every request ended with a complete stream + ``[DONE]`` or an in-band error event + ``[DONE]``
  (with one worker killed at a time, streams broken by a kill go on on another worker:
  ``continued``, and no in-band error is expected);
- every complete stream is exactly the stream a worker produces for its request uninterrupted:
  the same reasoning and answer text, in the same number of text chunks, with the same
  ``finish_reason`` (the requests are seeded, drawn from a few bodies whose streams are fetched
  from a worker before the chaos: ``references``); a continued stream repeats or loses nothing;
  none hung past ``--request-timeout`` and none failed outright (HTTP error / truncated stream);
- none failed before its commit point (no relayed event yet): those must have been retried;
- no client request (X-Request-Id) was generated to completion twice, and every complete stream
  has exactly one completed generation on record;
- afterwards, gateway RSS is back near its post-warm-up baseline and open fds are at most the
  baseline plus the connection pool's size (one connection per concurrent request, plus the health
  checker's one per worker).

The report (JSON on stdout) counts ok / in-band errors / retried / failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.processes import PYTHON, ManagedProcess, ProcessManager

MODEL = "moonshotai/Kimi-K2.5"
PROMPTS = (
    "Why is the sky blue?",
    "Write a Python function that merges two sorted lists.",
    "A train leaves at 3 pm going 60 mph; when has it gone 150 miles?",
    "Summarise the causes of the French Revolution.",
)


@dataclass(frozen=True)
class ChaosConfig:
    workers: int = 3
    concurrency: int = 64
    duration_s: float = 30.0
    kill_every_s: float = 10.0
    down_s: float = 1.0
    warmup_s: float = 4.0
    speed: float = 2.0
    max_tokens: tuple[int, ...] = (32, 80, 136, 192)
    request_timeout_s: float = 60.0
    settle_s: float = 30.0  # how long to wait for in-flight requests to drain afterwards
    rss_slack_kib: int = 32 * 1024
    seed: int = 1


@dataclass
class Outcome:
    request_id: str
    kind: str  # ok | inband_error | failed
    events: int = 0  # data events before [DONE] (the error event included)
    body: tuple[str, int] = ("", 0)  # (prompt, max_tokens): which reference it must match
    stream: Stream | None = None  # what an ok stream carried
    status: int = 0
    detail: str = ""


@dataclass
class ChaosReport:
    requests: int = 0
    ok: int = 0
    inband_errors: int = 0
    failed: int = 0
    retried: int = 0
    retried_ok: int = 0
    continued: int = 0  # requests whose stream went on on another worker (access log)
    compared: int = 0  # complete streams compared with the worker's own stream
    text_mismatches: list[str] = field(default_factory=list)  # ...that differ from it
    kills: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    failed_ids: list[str] = field(default_factory=list)
    precommit_failures: list[str] = field(default_factory=list)
    generated_twice: list[str] = field(default_factory=list)
    ok_without_record: list[str] = field(default_factory=list)
    unlogged: int = 0
    rss_baseline_kib: int = 0
    rss_after_kib: int = 0
    fds_baseline: int = 0
    fds_after: int = 0
    pool_size: int = 0
    in_flight_after: int = -1
    rss_slack_kib: int = 32 * 1024

    @property
    def violations(self) -> list[str]:
        out = []
        if self.failed:
            out.append(f"{self.failed} requests failed outright: {self.failures}")
        if self.text_mismatches:
            out.append(f"streams unlike the worker's own: {self.text_mismatches[:5]}")
        if self.precommit_failures:
            out.append(f"failed before the commit point: {self.precommit_failures[:5]}")
        if self.generated_twice:
            out.append(f"generated to completion twice: {self.generated_twice[:5]}")
        if self.ok_without_record:
            out.append(
                f"complete streams with no generation on record: {self.ok_without_record[:5]}"
            )
        if self.in_flight_after != 0:
            out.append(f"{self.in_flight_after} requests still in flight afterwards")
        if self.rss_after_kib > self.rss_baseline_kib + self.rss_slack_kib:
            out.append(f"RSS {self.rss_after_kib} KiB vs baseline {self.rss_baseline_kib} KiB")
        if self.fds_after > self.fds_baseline + self.pool_size:
            out.append(f"fds {self.fds_after} > {self.fds_baseline} + pool {self.pool_size}")
        return out

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "violations": self.violations}


# -- processes -----------------------------------------------------------------------------------


def start_stack(
    procs: ProcessManager, config: ChaosConfig, stats_dir: Path
) -> tuple[ManagedProcess, list[ManagedProcess]]:
    emus = []
    for i in range(config.workers):
        argv = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", str(config.speed)]
        argv += ["--seed", str(config.seed + i), "--stats-file", str(stats_dir / f"emu-{i}.jsonl")]
        argv += ["--log-level", "warning"]
        emus.append(procs.start(argv, name=f"emu-{i}", ready_path="/health", ready_status=200))
    argv = [PYTHON, "-m", "app", "serve", "--port", "{port}"]
    for emu in emus:
        argv += ["--worker-url", emu.url]
    env = {
        "DFLASH_GATEWAY_LOG_JSON": "true",
        "DFLASH_GATEWAY_LOG_LEVEL": "info",
        # A dead worker leaves the routable set within about a second.
        "DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.25",
        "DFLASH_GATEWAY_HEALTH__TIMEOUT_S": "1",
        "DFLASH_GATEWAY_HEALTH__FAILURE_THRESHOLD": "2",
        "DFLASH_GATEWAY_HEALTH__LOADS_INTERVAL_S": "0.5",
        "DFLASH_GATEWAY_TIMEOUTS__CONNECT_S": "2",
    }
    gw = procs.start(argv, name="gateway", ready_path="/readyz", ready_status=200, env=env)
    return gw, emus


def _proc_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _in_flight(client: httpx.AsyncClient, gw: ManagedProcess) -> int:
    table = (await client.get(gw.url + "/workers")).json()
    return int(table.get("queued", 0)) + sum(int(w["in_flight"]) for w in table["workers"])


async def _drained(client: httpx.AsyncClient, gw: ManagedProcess, timeout: float) -> int:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while True:
        left = await _in_flight(client, gw)
        if left == 0 or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.1)


# -- what a worker produces ---------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """A chat stream as its client reads it: the text, the chunks that carried text, the end."""

    reasoning: str
    content: str
    chunks: int
    finish: str | None

    @classmethod
    def of(cls, payloads: list[dict[str, Any]]) -> Stream:
        reasoning, content, chunks, finish = [], [], 0, None
        for p in payloads:
            for choice in p.get("choices") or ():
                delta = choice.get("delta") or {}
                r, c = delta.get("reasoning_content") or "", delta.get("content") or ""
                reasoning.append(r)
                content.append(c)
                chunks += bool(r or c)
                finish = choice.get("finish_reason") or finish
        return cls("".join(reasoning), "".join(content), chunks, finish)


def request_body(config: ChaosConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": max_tokens,
        "seed": config.seed,  # the same stream on every worker
        "messages": [{"role": "user", "content": prompt}],
    }


async def references(config: ChaosConfig, worker: ManagedProcess) -> dict[tuple[str, int], Stream]:
    """The stream ``worker`` produces for each request body the clients send, uninterrupted."""
    async with httpx.AsyncClient(timeout=config.request_timeout_s, trust_env=False) as client:

        async def one(prompt: str, max_tokens: int) -> Stream:
            body = request_body(config, prompt, max_tokens)
            r = await client.post(worker.url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
            return Stream.of([orjson.loads(e) for e in events if e != "[DONE]"])

        keys = [(p, m) for p in PROMPTS for m in config.max_tokens]
        streams = await asyncio.gather(*(one(p, m) for p, m in keys))
    return dict(zip(keys, streams, strict=True))


# -- clients -------------------------------------------------------------------------------------


async def one_request(
    client: httpx.AsyncClient,
    gw: ManagedProcess,
    request_id: str,
    body: dict[str, Any],
    begun: asyncio.Event | None = None,
) -> Outcome:
    """One streamed request through the gateway, classified; ``begun`` is set once its first
    data event arrived (the stream is past its commit point)."""
    out = Outcome(request_id, "failed")
    headers = {"x-request-id": request_id}
    try:
        async with client.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.detail = f"http {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            events: list[bytes] = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:].encode())
                    if begun is not None:
                        begun.set()
    except httpx.HTTPError as exc:
        out.detail = f"transport: {type(exc).__name__}"
        return out
    return classify(out, events)


def classify(out: Outcome, events: list[bytes]) -> Outcome:
    if not events or events[-1] != b"[DONE]":
        out.detail = "stream ended without [DONE]"
        return out
    payloads = [orjson.loads(e) for e in events[:-1]]
    out.events = len(payloads)
    errors = [i for i, p in enumerate(payloads) if "error" in p]
    if errors:
        if errors != [len(payloads) - 1]:
            out.detail = "error event not right before [DONE]"
            return out
        out.kind = "inband_error"
        out.detail = str(payloads[-1]["error"].get("code"))
        return out
    finished = any(
        choice.get("finish_reason") for p in payloads for choice in p.get("choices") or ()
    )
    if not finished:
        out.detail = "[DONE] without a finish_reason"
        return out
    out.kind = "ok"
    out.stream = Stream.of(payloads)
    return out


async def client_loop(
    client: httpx.AsyncClient,
    gw: ManagedProcess,
    config: ChaosConfig,
    deadline: float,
    prefix: str,
    rng: random.Random,
    results: list[Outcome],
) -> None:
    n = 0
    while time.monotonic() < deadline:
        n += 1
        request_id = f"{prefix}-{n}"
        key = (rng.choice(PROMPTS), rng.choice(config.max_tokens))
        body = request_body(config, *key)
        try:
            async with asyncio.timeout(config.request_timeout_s):
                out = await one_request(client, gw, request_id, body)
        except TimeoutError:
            out = Outcome(request_id, "failed", detail="hung (client timeout)")
        out.body = key
        results.append(out)


async def killer(
    procs: ProcessManager, emus: list[ManagedProcess], config: ChaosConfig, deadline: float
) -> int:
    kills = 0
    victim = 0
    while True:
        await asyncio.sleep(config.kill_every_s)
        if time.monotonic() >= deadline:
            return kills
        emu = emus[victim % len(emus)]
        victim += 1
        await asyncio.to_thread(emu.kill)
        kills += 1
        await asyncio.sleep(config.down_s)
        await asyncio.to_thread(procs.restart, emu, ready_path="/health")


async def load(
    gw: ManagedProcess,
    config: ChaosConfig,
    seconds: float,
    prefix: str,
    procs: ProcessManager | None = None,
    emus: list[ManagedProcess] | None = None,
) -> tuple[list[Outcome], int]:
    # Idle connections are dropped well before the gateway drops them (as a client pool should).
    limits = httpx.Limits(
        max_connections=config.concurrency + 8, max_keepalive_connections=None, keepalive_expiry=2.0
    )
    timeout = httpx.Timeout(config.request_timeout_s, connect=5.0)
    rng = random.Random(config.seed)
    results: list[Outcome] = []
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        clients = [
            client_loop(
                client, gw, config, deadline, f"{prefix}{i}", random.Random(rng.random()), results
            )
            for i in range(config.concurrency)
        ]
        kills = 0
        if procs is not None and emus is not None:
            chaos = asyncio.ensure_future(killer(procs, emus, config, deadline))
            await asyncio.gather(*clients)
            kills = await chaos
        else:
            await asyncio.gather(*clients)
    return results, kills


# -- ground truth --------------------------------------------------------------------------------


def _json_lines(path: Path) -> Iterator[dict[str, Any]]:
    with contextlib.suppress(FileNotFoundError), path.open("rb") as f:
        for line in f:
            if line.startswith(b"{"):
                with contextlib.suppress(orjson.JSONDecodeError):
                    yield orjson.loads(line)


def _access(gateway_log: Path) -> Iterator[dict[str, Any]]:
    for doc in _json_lines(gateway_log):
        if doc.get("logger") == "dflash_gateway.access" and "request_id" in doc:
            yield doc


def access_attempts(gateway_log: Path) -> dict[str, int]:
    """Attempts per request, by the client's X-Request-Id (``client_request_id``)."""
    return {
        doc.get("client_request_id") or doc["request_id"]: int(doc.get("attempts") or 0)
        for doc in _access(gateway_log)
    }


def access_continued(gateway_log: Path) -> int:
    """Requests the access log says were continued on another worker after a break."""
    return sum(
        1
        for doc in _json_lines(gateway_log)
        if doc.get("logger") == "dflash_gateway.access" and (doc.get("continuations") or 0) > 0
    )


def completed_generations(stats_dir: Path) -> Counter[str]:
    """Completed generations per request, by the client's X-Request-Id (which its workers were
    sent)."""
    done: Counter[str] = Counter()
    for path in stats_dir.glob("*.jsonl"):
        for rec in _json_lines(path):
            finished = rec.get("finish_reason") and not rec.get("aborted")
            if rec.get("request_id") and finished and not rec.get("error"):
                done[rec["request_id"]] += 1
    return done


def check(
    report: ChaosReport,
    results: list[Outcome],
    attempts: dict[str, int],
    done: Counter[str],
    want: dict[tuple[str, int], Stream] | None = None,
) -> None:
    report.requests = len(results)
    kinds = Counter(r.kind for r in results)
    report.ok, report.inband_errors, report.failed = (
        kinds["ok"],
        kinds["inband_error"],
        kinds["failed"],
    )
    report.failures = dict(Counter(r.detail for r in results if r.kind == "failed"))
    report.failed_ids = [r.request_id for r in results if r.kind == "failed"][:20]
    for r in results:
        tries = attempts.get(r.request_id)
        if tries is None:
            report.unlogged += 1
        elif tries > 1:
            report.retried += 1
            report.retried_ok += r.kind == "ok"
        # Before the commit point nothing was relayed: such a failure must have been retried.
        if (r.kind == "inband_error" and r.events <= 1) or (r.kind == "failed" and r.status >= 500):
            report.precommit_failures.append(r.request_id)
        if r.kind == "ok" and done[r.request_id] == 0:
            report.ok_without_record.append(r.request_id)
        if r.kind == "ok" and want is not None and r.body in want:
            report.compared += 1
            if r.stream != want[r.body]:
                report.text_mismatches.append(r.request_id)
    report.generated_twice = sorted(rid for rid, n in done.items() if n > 1)


# -- the run -------------------------------------------------------------------------------------


async def run_chaos(procs: ProcessManager, config: ChaosConfig, workdir: Path) -> ChaosReport:
    stats_dir = workdir / "stats"
    stats_dir.mkdir(parents=True, exist_ok=True)
    gw, emus = start_stack(procs, config, stats_dir)
    report = ChaosReport(rss_slack_kib=config.rss_slack_kib)
    report.pool_size = config.concurrency + config.workers
    want = await references(config, emus[0])
    async with httpx.AsyncClient(timeout=10, trust_env=False) as control:
        await load(gw, config, config.warmup_s, "warmup-")
        await _drained(control, gw, config.settle_s)
        report.rss_baseline_kib, report.fds_baseline = _proc_kib(gw.pid), _fds(gw.pid)
        results, report.kills = await load(gw, config, config.duration_s, "c", procs, emus)
        report.in_flight_after = await _drained(control, gw, config.settle_s)
        report.rss_after_kib, report.fds_after = _proc_kib(gw.pid), _fds(gw.pid)
    # A request leaves the in-flight count a moment before its access-log line is written.
    wanted = {r.request_id for r in results}
    deadline = time.monotonic() + 5
    attempts = access_attempts(gw.log_path)
    while not wanted <= attempts.keys() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        attempts = access_attempts(gw.log_path)
    check(report, results, attempts, completed_generations(stats_dir), want)
    report.continued = access_continued(gw.log_path)
    return report


def main(argv: list[str] | None = None) -> int:
    defaults = ChaosConfig()
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of chaos (default 300)")
    p.add_argument("--workers", type=int, default=defaults.workers)
    p.add_argument("--concurrency", type=int, default=defaults.concurrency)
    p.add_argument("--kill-every", type=float, default=defaults.kill_every_s)
    p.add_argument(
        "--down", type=float, default=defaults.down_s, help="seconds a killed worker stays down"
    )
    p.add_argument("--speed", type=float, default=defaults.speed, help="emulator time scale")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and stats files here")
    args = p.parse_args(argv)
    config = ChaosConfig(
        workers=args.workers,
        concurrency=args.concurrency,
        duration_s=args.duration,
        kill_every_s=args.kill_every,
        down_s=args.down,
        speed=args.speed,
    )
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        procs = ProcessManager(workdir)
        try:
            report = asyncio.run(run_chaos(procs, config, workdir))
        finally:
            procs.stop_all()
    print(orjson.dumps(report.summary(), option=orjson.OPT_INDENT_2).decode())
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())

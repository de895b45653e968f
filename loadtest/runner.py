"""Closed-loop load against an OpenAI-compatible endpoint, measuring what the seed card reports.

``concurrency`` clients each send their next request as soon as the previous one ends. The first
``concurrency`` requests are a warm-up and are not measured. Throughput is the seed's definition:
sum of completion tokens / wall time of the measured phase (prefill, queueing and the tail
included).

Per request: TTFT (first content-bearing chunk; streams only), gaps between
chunks, end-to-end latency, completion tokens and the acceptance length: exact (SGLang's
``meta_info.spec_accept_length``, requested with ``return_meta_info``) for non-streaming requests;
for streams an estimate, completion tokens / token-bearing chunks (one chunk ≈ one verify step).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

Progress = Callable[[int, int], None]


@dataclass
class RunConfig:
    base_url: str
    model: str = "moonshotai/Kimi-K2.5"
    concurrency: int = 32
    max_tokens: int = 4096
    thinking: bool = True
    temperature: float = 0.0
    stream: bool = False
    api_key: str | None = None
    profile: str | None = None  # sent as X-Emulator-Profile; real workers ignore it
    timeout_s: float = 3600.0


@dataclass
class RequestResult:
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    accept_length: float | None = None
    accept_source: str | None = None  # "exact" | "estimated"
    error: str | None = None


@dataclass
class PhaseResult:
    results: list[RequestResult]
    wall_s: float

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results if r.ok)

    @property
    def output_tok_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0


def request_body(config: RunConfig, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "stream": config.stream,
        "chat_template_kwargs": {"thinking": config.thinking},
    }
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    else:
        body["return_meta_info"] = True
    return body


def _headers(config: RunConfig) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    if config.profile:
        headers["X-Emulator-Profile"] = config.profile
    return headers


async def one_request(client: httpx.AsyncClient, config: RunConfig, prompt: str) -> RequestResult:
    body = orjson.dumps(request_body(config, prompt))
    start = time.perf_counter()
    try:
        if config.stream:
            return await _streamed(client, config, body, start)
        response = await client.post("/v1/chat/completions", content=body, headers=_headers(config))
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            return RequestResult(
                ok=False, e2e_s=elapsed, error=f"HTTP {response.status_code}: {response.text[:200]}"
            )
        data = orjson.loads(response.content)
        choice = data["choices"][0]
        meta = choice.get("meta_info") or {}
        accept = meta.get("spec_accept_length")
        return RequestResult(
            ok=True,
            e2e_s=elapsed,  # no TTFT without a stream
            completion_tokens=int(data.get("usage", {}).get("completion_tokens", 0)),
            accept_length=float(accept) if accept is not None else None,
            accept_source="exact" if accept is not None else None,
        )
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        return RequestResult(
            ok=False, e2e_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}"
        )


async def _streamed(
    client: httpx.AsyncClient, config: RunConfig, body: bytes, start: float
) -> RequestResult:
    result = RequestResult(ok=False, e2e_s=0.0)
    steps = 0
    last: float | None = None
    done = False
    async with client.stream(
        "POST", "/v1/chat/completions", content=body, headers=_headers(config)
    ) as response:
        if response.status_code != 200:
            raw = await response.aread()
            result.e2e_s = time.perf_counter() - start
            result.error = f"HTTP {response.status_code}: {raw[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            chunk = orjson.loads(payload)
            if "error" in chunk:
                result.error = str(chunk["error"].get("message", chunk["error"]))
                continue
            usage = chunk.get("usage")
            if usage and not chunk.get("choices"):
                result.completion_tokens = int(usage.get("completion_tokens", 0))
                continue
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.gaps_s.append(now - last)
                last = now
                steps += 1
    result.e2e_s = time.perf_counter() - start
    result.ok = done and result.error is None
    if not done and result.error is None:
        result.error = "stream ended without [DONE]"
    if result.ok and steps and result.completion_tokens:
        result.accept_length = result.completion_tokens / steps
        result.accept_source = "estimated"
    return result


async def closed_loop(
    client: httpx.AsyncClient,
    config: RunConfig,
    prompts: Sequence[str],
    progress: Progress | None = None,
) -> PhaseResult:
    """Send every prompt once with ``config.concurrency`` requests always in flight."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []

    async def client_loop() -> None:
        while True:
            try:
                prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(client, config, prompt))
            if progress is not None:
                progress(len(results), len(prompts))

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(min(config.concurrency, len(prompts)))))
    return PhaseResult(results=results, wall_s=time.perf_counter() - start)


async def run(
    config: RunConfig, prompts: Sequence[str], progress: Progress | None = None
) -> PhaseResult:
    """Warm up with the first ``concurrency`` prompts, then measure the rest."""
    limits = httpx.Limits(
        max_connections=config.concurrency + 4, max_keepalive_connections=config.concurrency + 4
    )
    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"),
        limits=limits,
        timeout=httpx.Timeout(config.timeout_s, connect=10.0),
    ) as client:
        warmup, measured = prompts[: config.concurrency], prompts[config.concurrency :]
        if not measured:  # too few prompts to spare a warm-up: measure them all
            warmup, measured = [], prompts
        if warmup:
            await closed_loop(client, config, warmup)
        return await closed_loop(client, config, measured, progress)


def progress_bar(label: str) -> Progress:
    """A one-line progress bar on stderr (only when it is a terminal)."""

    def show(done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{label:<10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show

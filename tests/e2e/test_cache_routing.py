"""cache_aware (the default policy) with real processes: agent-like sessions through the gateway in
front of emulated workers whose prefix caches are LRU pools of a set size; the hit rate comes from
the workers' own usage reports, and the operator's metrics tell it per worker and why each request
went where it did."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from loadtest.processes import PYTHON
from tests.e2e.conftest import gateway, poll
from tests.support.procs import ManagedProcess, ProcessManager

CHAT = "/v1/chat/completions"
WORDS = [
    "def",
    "class",
    "return",
    "import",
    "value",
    "index",
    "worker",
    "cache",
    "token",
    "session",
    "module",
]


def _text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens * 4 // 6))


def _emulator(procs: ProcessManager, name: str, pool: int) -> ManagedProcess:
    argv = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "20"]
    return procs.start([*argv, "--max-total-tokens", str(pool)], name=name)


def _session(
    url: str, system: str, index: int, turns: int, start: threading.Barrier | None = None
) -> None:
    rng = random.Random(index)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Repository {index}: " + _text(rng, 1500)},
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        if start is not None:
            start.wait(timeout=30)  # every session's first turn sent at once
        for turn in range(turns):
            body = {"model": "kimi-k2.5", "messages": messages, "max_tokens": 8}
            body["chat_template_kwargs"] = {"thinking": False}
            response = client.post(CHAT, json=body)
            assert response.status_code == 200, response.text
            answer = response.json()["choices"][0]["message"]["content"] or "ok"
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"Step {turn}: " + _text(rng, 100)},
            ]


def _totals(emu: ManagedProcess) -> dict[str, int]:
    stats = httpx.get(emu.url + "/emulator/stats", params={"limit": 0}, timeout=5).json()
    return stats["totals"]  # type: ignore[no-any-return]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_sessions_find_their_cache_spread_over_the_workers(procs: ProcessManager) -> None:
    emus = [_emulator(procs, f"emu-{i}", 100_000) for i in range(3)]
    gw = gateway(procs, emus)  # the default policy
    workers = httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
    poll(lambda: all(w["capacity"]["max_total_num_tokens"] == 100_000 for w in workers))
    system = "You are a coding agent. " + _text(random.Random(0), 1000)
    sessions, turns = 9, 4
    start = threading.Barrier(sessions)
    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(lambda i: _session(gw.url, system, i, turns, start), range(sessions)))
    totals = [_totals(emu) for emu in emus]
    prompt = sum(t["prompt_tokens"] for t in totals)
    cached = sum(t["cached_tokens"] for t in totals)
    # Each session's history is found on its worker: only the shared prompt (once per session:
    # they all start at once), each session's own context once and each turn's new text are
    # computed, ~0.72 of the prompt tokens served from cache; a session's turn sent elsewhere
    # would recompute its history (least_inflight: ~0.5).
    assert cached / prompt > 0.65
    # ... and the sessions are spread: every worker serves some, none most.
    requests = [t["requests"] for t in totals]
    assert sum(requests) == sessions * turns
    assert min(requests) >= turns and max(requests) <= sessions * turns // 2
    # Operators see it: per worker, the prompt tokens and those its cache served; and why each
    # request went where it did.
    metrics = httpx.get(gw.url + "/metrics", timeout=5).text
    for emu in emus:
        worker = emu.url.removeprefix("http://")
        seen = _metric(metrics, "dflash_gateway_cached_prompt_tokens_total", worker=worker)
        assert seen == _totals(emu)["cached_tokens"]
    decisions = _metric(metrics, "dflash_gateway_routing_decisions_total", policy="cache_aware")
    assert decisions == sessions * turns
    assert _metric(metrics, "dflash_gateway_routing_decisions_total", reason="affinity") > 0

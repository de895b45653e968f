"""The emulated worker's prefix cache: pages, the last-token rule, LRU leaf-first eviction under
``--max-total-tokens``, locks; and what a real worker reports about it (``cached_tokens``,
``/server_info``, ``/v1/loads``) on a running emulator."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from app.emulator.cache import PrefixCache
from tests.support.procs import PYTHON, ProcessManager

EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"]
PAGE = 4
CHARS = PAGE * 4  # characters in one page (4 characters a token)


def _text(seed: int, pages: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij") for _ in range(pages * CHARS))


def _serve(cache: PrefixCache, prompt: str, reserved: int = 0) -> int:
    """One request: match, insert after "prefill", finish; returns its cached tokens."""
    keys = cache.keys(prompt)
    cached, held = cache.match(keys, -(-len(prompt) // 4))
    path = cache.insert(prompt, keys, held, reserved)
    cache.unlock(path)
    return cached


def test_whole_pages_and_never_the_last_token() -> None:
    cache = PrefixCache(1000, PAGE)
    prompt = _text(1, 3) + "xy"  # 3 whole pages and a partial one
    assert len(cache.keys(prompt)) == 3
    assert _serve(cache, prompt) == 0
    assert _serve(cache, prompt) == 3 * PAGE
    exact = _text(1, 3)  # exactly 3 pages: its last token is always computed
    assert _serve(cache, exact) == 2 * PAGE
    assert _serve(cache, "z" + prompt[1:]) == 0, "a different first page invalidates the chain"


def test_lru_evicts_leaves_first_and_a_shared_prefix_survives() -> None:
    cache = PrefixCache(10 * PAGE, PAGE)
    shared = _text(0, 4)
    a, b = shared + _text(1, 2), shared + _text(2, 2)
    _serve(cache, a)
    _serve(cache, b)  # 8 pages cached, the 4 shared ones once
    assert cache.used_tokens == 8 * PAGE
    assert _serve(cache, a + "!") == 6 * PAGE  # a is now the most recently used
    _serve(cache, _text(3, 4))  # 4 new pages: 2 must go, b's tail (the oldest leaves)
    assert cache.used_tokens <= 10 * PAGE
    assert _serve(cache, a + "!") == 6 * PAGE, "the recently used prompt stays whole"
    assert _serve(cache, b + "!") == 4 * PAGE, "b lost its own pages, not the shared prefix"


def test_bounded_by_max_total_tokens_and_reserved_tokens() -> None:
    cache = PrefixCache(50 * PAGE, PAGE)
    for seed in range(40):
        _serve(cache, _text(seed, 7))
        assert cache.used_tokens <= 50 * PAGE
    assert cache.used_tokens == 50 * PAGE, "a full pool evicts pages, not whole prompts"
    _serve(cache, _text(99, 7), reserved=30 * PAGE)  # running requests hold 30 pages' worth
    assert cache.used_tokens <= 20 * PAGE
    assert cache.evicted_tokens > 0


def test_a_running_requests_pages_are_not_evicted() -> None:
    cache = PrefixCache(8 * PAGE, PAGE)
    running = _text(1, 4)
    keys = cache.keys(running)
    _, held = cache.match(keys, 4 * PAGE)
    path = cache.insert(running, keys, held, 0)  # still running: locked
    idle = _text(2, 4)
    _serve(cache, idle)
    _serve(cache, _text(3, 4))  # pressure: 4 pages must go, and only the idle ones can
    assert cache.used_tokens == 8 * PAGE
    cache.unlock(path)
    assert _serve(cache, running + "!") == 4 * PAGE
    assert _serve(cache, idle + "!") == 0
    cache.flush()
    assert cache.used_tokens == 0
    assert _serve(cache, running + "!") == 0


def _chat(client: httpx.Client, content: str) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()["usage"]
    return usage


@pytest.mark.processes
def test_small_pool_evicts_and_reports_like_sglang(procs: ProcessManager) -> None:
    emu = procs.start(
        [*EMULATE, "--max-total-tokens", "4096", "--page-size", "32"],
        name="emu",
    )
    with httpx.Client(base_url=emu.url, timeout=30) as client:
        info = client.get("/server_info").json()
        assert info["max_total_num_tokens"] == info["max_total_tokens"] == 4096
        assert info["page_size"] == 32
        assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 4096
        load = client.get("/v1/loads").json()["loads"][0]
        assert load["max_total_num_tokens"] == 4096 and load["token_usage"] == 0
        first = "first document " * 500  # ~1,900 tokens
        assert _chat(client, first)["prompt_tokens_details"]["cached_tokens"] == 0
        warm = _chat(client, first + " and more")["prompt_tokens_details"]["cached_tokens"]
        assert warm >= 1800 and warm % 32 == 0
        for i in range(3):  # ~5,700 more tokens through a 4,096-token pool
            _chat(client, f"other document {i} " * 480)
        evicted = _chat(client, first)["prompt_tokens_details"]["cached_tokens"]
        assert evicted < warm, "the first document was the least recently used"
        load = client.get("/v1/loads").json()["loads"][0]
        assert 0 < load["cache_hit_rate"] < 1

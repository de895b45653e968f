"""A worker that writes a late, complete, well-framed second response on a keep-alive connection
(0, 5, 50 and 200 ms after each answer) in front of a real gateway process, while other clients
keep sending requests: no client ever gets another request's bytes. Each gets its own answer or
a 502 (when the stray was read as its answer and no other worker was left to try)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.e2e.conftest import gateway
from tests.support.procs import ManagedProcess, managed_processes
from tests.support.stray_worker import MODEL, STRAY_TEXT, StrayWorker

ROUNDS = 200
CLIENTS = 4


@pytest.fixture(scope="module")
def stray_gw(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ManagedProcess, StrayWorker]]:
    with StrayWorker() as worker, managed_processes(tmp_path_factory, "stray") as manager:
        # Every failure here is the worker's: keep its breaker closed throughout.
        env = {"DFLASH_GATEWAY_BREAKER__FAILURE_THRESHOLD": "1000000"}
        yield gateway(manager, [worker.url], env=env), worker


def _content(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return str(response.json()["choices"][0]["message"]["content"])
    text = ""
    for event in response.text.split("\n\n"):
        if event.startswith("data: {"):
            for choice in orjson.loads(event[6:]).get("choices") or ():
                text += choice["delta"].get("content") or ""
    assert response.text.endswith("data: [DONE]\n\n")
    return text


def _violations(gw: ManagedProcess) -> float:
    total = 0.0
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("dflash_gateway_upstream_violations_total{") and "foreign" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _client(url: str, number: int, seen: dict[int, int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:  # its own connections
        for round_ in range(ROUNDS):
            tag = f"client{number}-round{round_}"
            stream = (round_ + number) % 2 == 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": tag}],
                "stream": stream,
            }
            response = await http.post("/v1/chat/completions", json=body)
            assert STRAY_TEXT not in response.text, (tag, response.text)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            if response.status_code == 200:
                assert _content(response, stream) == tag
            else:
                assert response.status_code == 502, response.text
                assert "[DONE]" not in response.text  # refused before a byte was relayed


def test_a_late_stray_response_never_reaches_another_client(
    stray_gw: tuple[ManagedProcess, StrayWorker],
) -> None:
    gw, worker = stray_gw

    async def main() -> dict[int, int]:
        seen: dict[int, int] = {}
        await asyncio.gather(*(_client(gw.url, n, seen) for n in range(CLIENTS)))
        return seen

    seen = asyncio.run(main())
    print("statuses", seen, "strays sent", worker.strays, "caught by id", _violations(gw))
    assert sum(seen.values()) == ROUNDS * CLIENTS
    assert worker.strays >= ROUNDS  # written on connections still open
    assert seen.get(200, 0) > ROUNDS  # most answers get through
    # A stray read as the next answer is refused by its id (counted), or by its shape when it
    # is the other kind of answer (a whole one for a stream, or the reverse), or as bytes after
    # the end of an answer when it came in the same write.
    assert 0 < _violations(gw) <= seen.get(502, 0)


def test_delays_cycle_through_every_timing() -> None:
    worker = StrayWorker()
    delays = list(itertools.islice(worker._delays, 8))
    assert delays == [0, 5, 50, 200, 0, 5, 50, 200]

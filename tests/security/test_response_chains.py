"""What ``previous_response_id`` and stored responses let one key do, seen from the worker and
from other keys: a real gateway process (memory store, or a real redis-server) in front of a
recording worker (tests/security/recorder.py) that keeps the exact bytes it was sent."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.security.recorder import MODEL, recording_worker
from tests.security.stack import error_of, start_gateway
from tests.support.procs import ProcessManager

RESPONSES = "/v1/responses"
LIMIT = 256 * 1024  # limits.max_body_bytes of these gateways
# What the gateway adds to a body it forwards (rid, max_tokens), never the client's bytes.
GATEWAY_FIELDS = 512


def _store_env(store: str, request: pytest.FixtureRequest) -> dict[str, str]:
    env = {"DFLASH_GATEWAY_RESPONSES__STORE": store}
    if store == "redis":
        env["DFLASH_GATEWAY_LIMITS__REDIS_URL"] = request.getfixturevalue("redis_url")
    return env


def _respond(gw_url: str, text: str, previous: str | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "input": text, **extra}
    if previous is not None:
        body["previous_response_id"] = previous
    return httpx.post(gw_url + RESPONSES, json=body, timeout=60)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_chain_of_previous_response_ids_is_held_to_the_body_limit(
    procs: ProcessManager, request: pytest.FixtureRequest, store: str
) -> None:
    """Each request is under the body limit, but the conversation it continues is not sent on
    once stored turns and new input together pass it: a 400 naming the setting, and the worker
    never receives more than the limit."""
    env = _store_env(store, request) | {"DFLASH_GATEWAY_LIMITS__MAX_BODY_BYTES": str(LIMIT)}
    with recording_worker() as worker:
        gw = start_gateway(procs, [], args=("--worker-url", worker.url), env=env)
        chunk = "x" * (LIMIT * 4 // 10)  # 40% of the limit per turn
        first = _respond(gw.url, chunk)
        assert first.status_code == 200, first.text
        second = _respond(gw.url, chunk, first.json()["id"])
        assert second.status_code == 200, second.text  # 80% of the limit: still fits
        third = _respond(gw.url, chunk, second.json()["id"])
        assert third.status_code == 400, third.text
        error = error_of(third)
        assert error["type"] == "invalid_request_error"
        assert error["param"] == "previous_response_id"
        assert "limits.max_body_bytes" in error["message"] and str(LIMIT) in error["message"]
        # Many small requests continuing the largest conversation that fits: each one alone is
        # tiny, none sends the worker more than the limit.
        for _ in range(4):
            small = _respond(gw.url, "and?", second.json()["id"])
            assert small.status_code == 200, small.text
        near = _respond(gw.url, "y" * (LIMIT // 4), second.json()["id"])
        assert near.status_code == 400 and error_of(near)["param"] == "previous_response_id"
        assert len(worker.bodies) == 6  # the refused ones never reached it
        assert max(len(body) for body in worker.bodies) <= LIMIT + GATEWAY_FIELDS


A_KEY, B_KEY = "sk-tenant-a-0123456789abcdef", "sk-tenant-b-0123456789abcdef"
SHARE = 256 * 1024  # responses.key_max_bytes of the shared-store gateways


def _as(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_one_key_cannot_flush_another_keys_stored_responses(
    procs: ProcessManager, request: pytest.FixtureRequest, store: str
) -> None:
    """Key A writes far more than its share of the store (and than the whole in-process store);
    only A's own oldest responses go, B's stays readable and continuable."""
    env = _store_env(store, request) | {
        "DFLASH_GATEWAY_API_KEYS": f"team-a:{A_KEY},team-b:{B_KEY}",
        "DFLASH_GATEWAY_RESPONSES__MAX_BYTES": str(1024 * 1024),
        "DFLASH_GATEWAY_RESPONSES__KEY_MAX_BYTES": str(SHARE),
    }
    with recording_worker() as worker:
        gw = start_gateway(procs, [], args=("--worker-url", worker.url), env=env)
        body = {"model": MODEL, "input": "remember me"}
        kept = httpx.post(gw.url + RESPONSES, json=body, headers=_as(B_KEY), timeout=30)
        assert kept.status_code == 200, kept.text
        b_id = kept.json()["id"]
        # The largest metadata OpenAI allows is accepted (and echoed), 100 KiB of input each.
        metadata = {f"k{i:02d}" + "x" * 61: "v" * 512 for i in range(16)}
        a_ids = []
        for i in range(14):  # ~1.4 MiB: past the whole memory store, five times A's share
            big = {"model": MODEL, "input": f"{i} " + "y" * (100 * 1024), "metadata": metadata}
            answer = httpx.post(gw.url + RESPONSES, json=big, headers=_as(A_KEY), timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["metadata"] == metadata
            a_ids.append(answer.json()["id"])

        def stored(key: str, response_id: str) -> int:
            url = f"{gw.url}{RESPONSES}/{response_id}"
            return httpx.get(url, headers=_as(key), timeout=30).status_code

        # A's writes evicted A's own oldest, within its share...
        assert stored(A_KEY, a_ids[0]) == 404
        assert stored(A_KEY, a_ids[-1]) == 200
        # ... and nothing of B's.
        assert stored(B_KEY, b_id) == 200
        more = {**body, "input": "what did I say?", "previous_response_id": b_id}
        again = httpx.post(gw.url + RESPONSES, json=more, headers=_as(B_KEY), timeout=30)
        assert again.status_code == 200, again.text
        assert "remember me" in worker.bodies[-1].decode()
        if store == "redis":  # what A holds in Redis is its share, whatever it wrote
            import redis

            client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
            names = list(client.scan_iter(match="dflash-gateway:response:team-a:*"))
            held = sum(client.strlen(name) for name in names)
            assert 0 < held <= SHARE and len(names) < len(a_ids)
            client.close()

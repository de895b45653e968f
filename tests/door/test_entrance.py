"""The door (``app.door``): one ordered list of checks for every completion surface, and the
leases its checks hold for as long as the response lasts -- through real requests to the gateway
under its production server stack, with scripted workers on loopback."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

import orjson
import pytest

from app.accesslog import ACCESS_LOGGER
from app.door.entrance import Checks, checks
from app.door.visit import Visit
from app.errors import InvalidRequest
from app.gateway import Gateway
from app.proxy.job import Job
from app.proxy.request import ParsedRequest
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness, wait_for

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
SECRET = "sk-door-0123456789"
KEY = {"authorization": f"Bearer {SECRET}"}
ONE_AT_A_TIME = {"key_max_concurrent": 1}


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


def message(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
    } | extra


def keyed(**settings: Any) -> dict[str, Any]:
    return {"api_keys": [f"team:{SECRET}"], **settings}


class Probe:
    """A check holding a lease: counts what it took and gave back, and whether the request's
    answer had ended when it was given back."""

    def __init__(self) -> None:
        self.taken = 0
        self.released = 0
        self.ended_first: list[bool] = []

    def check(self, visit: Visit) -> None:
        self.taken += 1
        visit.hold(self)

    def release(self, visit: Visit, job: Job | None) -> None:
        self.released += 1
        self.ended_first.append(job is None or job.record.duration_ms is not None)


def with_probe(probe: Probe, before: str | None = None) -> Any:
    """The gateway's checks with ``probe`` just before the check named ``before`` (None: the last
    before the body is read): one line."""

    def build(gw: Gateway) -> Checks:
        found = checks(gw)
        names = [type(check).__name__ for check in found.before_body]
        at = len(names) if before is None else names.index(before)
        before_body = (*found.before_body[:at], probe, *found.before_body[at:])
        return replace(found, before_body=before_body)

    return build


def error_of(ex: Any) -> dict[str, Any]:
    doc: dict[str, Any] = ex.json()
    return doc


async def test_the_checks_are_built_once_from_the_configuration() -> None:
    def names(found: Checks) -> tuple[list[str], list[str]]:
        before, after = found.before_body, found.after_parse
        return [type(c).__name__ for c in before], [type(c).__name__ for c in after]

    async with GatewayHarness([FakeWorker()]) as gw:
        open_door = names(gw.app.door.checks)
    async with GatewayHarness([FakeWorker()], **keyed()) as gw:
        keyed_door = names(gw.app.door.checks)
    assert open_door == (["MediaType"], ["Accepting", "Model"])
    assert keyed_door == (["KeyLimits", "MediaType"], ["Accepting", "Model"])


async def raw_status(gw: GatewayHarness, head: bytes, body: bytes) -> int:
    """The status of a request sent as these bytes (for what an HTTP client would not send)."""
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        status_line = await reader.readline()
    finally:
        writer.close()
    return int(status_line.split()[1])


async def test_a_request_meets_the_checks_in_their_order() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker], **keyed()) as gw:
        text = {"content-type": "text/plain"}
        # Headers before the key: a repeated Authorization header is a 400, not a 401.
        twice = await raw_status(
            gw,
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: Bearer a\r\nauthorization: Bearer b\r\n"
            b"content-type: application/json\r\n",
            orjson.dumps(chat()),
        )
        # The key before the media type, the media type before the body and the model.
        no_key = await gw.request("POST", CHAT, raw=b"not json", headers=text)
        not_json = await gw.request("POST", CHAT, raw=b"not json", headers=KEY | text)
        # The body's validation before the model.
        invalid = await gw.post(CHAT, {"model": "gpt-9"}, headers=KEY)
        unknown = await gw.post(CHAT, chat(model="gpt-9"), headers=KEY)
        ok = await gw.post(CHAT, chat(), headers=KEY)
    assert twice == 400
    assert no_key.status == 401
    assert not_json.status == 415
    assert invalid.status == 400 and error_of(invalid)["error"]["param"] == "messages"
    assert unknown.status == 404
    assert ok.status == 200
    assert len(worker.requests) == 1  # only the request every check let through


async def test_the_key_limits_come_before_the_body() -> None:
    worker = FakeWorker(hold_after=1)
    async with GatewayHarness([worker], **keyed(limits=ONE_AT_A_TIME)) as gw:
        stream = asyncio.ensure_future(gw.post(CHAT, chat(stream=True), headers=KEY))
        await asyncio.wait_for(worker.held.wait(), 5)
        # The key's one slot is taken: a 429 even for a body that is not JSON.
        busy = await gw.request(
            "POST", CHAT, raw=b"not json", headers=KEY | {"content-type": "text/plain"}
        )
        worker.release.set()
        streamed = await stream
    assert busy.status == 429 and busy.headers.get("retry-after")
    assert streamed.status == 200 and streamed.body.endswith(b"data: [DONE]\n\n")


async def test_a_refusal_releases_the_leases_already_taken() -> None:
    probe = Probe()
    settings = keyed(limits=ONE_AT_A_TIME | {"max_body_bytes": 1024})
    async with GatewayHarness(
        [FakeWorker()], door_checks=with_probe(probe, "MediaType"), **settings
    ) as gw:
        refused = [
            await gw.request("POST", CHAT, raw=b"x", headers=KEY | {"content-type": "text/plain"}),
            await gw.post(CHAT, chat(padding="x" * 2048), headers=KEY),
            await gw.post(CHAT, {"model": MODEL}, headers=KEY),
            await gw.post(CHAT, chat(model="gpt-9"), headers=KEY),
        ]
        # Each refusal gave the key's one slot back: the next request is not a 429.
        ok = await gw.post(CHAT, chat(), headers=KEY)
    assert [ex.status for ex in refused] == [415, 413, 400, 404]
    assert ok.status == 200
    assert probe.taken == probe.released == 5


async def test_a_lease_follows_a_streamed_response_to_its_end() -> None:
    probe = Probe()
    worker = FakeWorker(hold_after=2)
    async with GatewayHarness(
        [worker], door_checks=with_probe(probe), **keyed(limits=ONE_AT_A_TIME)
    ) as gw:
        chunks: list[bytes] = []
        stream = asyncio.ensure_future(
            gw.post(CHAT, chat(stream=True), headers=KEY, on_chunk=chunks.append)
        )
        await asyncio.wait_for(worker.held.wait(), 5)
        await wait_for(lambda: chunks)
        # The response began and has not ended: the leases are still held.
        held = probe.released
        busy = await gw.post(CHAT, chat(), headers=KEY)
        worker.release.set()
        streamed = await stream
        await wait_for(lambda: probe.released == 1)
        after = await gw.post(CHAT, chat(), headers=KEY)
    assert held == 0
    assert busy.status == 429  # the key's slot went with the open stream (refused before Probe)
    assert streamed.status == 200 and streamed.body.endswith(b"data: [DONE]\n\n")
    assert after.status == 200
    assert probe.taken == probe.released == 2
    assert probe.ended_first == [True, True]


async def test_a_lease_is_released_when_the_client_leaves_a_stream() -> None:
    probe = Probe()
    worker = FakeWorker(hold_after=2)
    async with GatewayHarness(
        [worker], door_checks=with_probe(probe), **keyed(limits=ONE_AT_A_TIME)
    ) as gw:
        gone = asyncio.Event()

        def first(chunk: bytes) -> None:
            gone.set()

        left = await gw.post(CHAT, chat(stream=True), headers=KEY, disconnect=gone, on_chunk=first)
        await asyncio.wait_for(worker.closed.wait(), 5)  # the gateway aborted the worker's stream
        await wait_for(lambda: probe.released == 1)
        after = await gw.post(CHAT, chat(), headers=KEY)
    assert not left.complete
    assert after.status == 200  # the key's slot came back with the client's leaving
    assert probe.taken == probe.released == 2


class NoStreams:
    """An admission rule of the kind an operator adds: no streamed answers here."""

    def check(self, visit: Visit, request: ParsedRequest) -> None:
        if request.stream:
            raise InvalidRequest("streamed answers are off on this gateway", param="stream")


async def test_a_check_added_in_one_line_applies_to_every_surface() -> None:
    worker = FakeWorker()

    def build(gw: Gateway) -> Checks:
        found = checks(gw)
        return replace(found, after_parse=(*found.after_parse, NoStreams()))

    async with GatewayHarness([worker], door_checks=build) as gw:
        openai = await gw.post(CHAT, chat(stream=True))
        anthropic = await gw.post(MESSAGES, message(stream=True))
        whole = await gw.post(CHAT, chat())
        metrics = (await gw.request("GET", "/metrics")).body.decode()
    assert openai.status == 400
    assert error_of(openai)["error"]["param"] == "stream"  # OpenAI's shape
    assert anthropic.status == 400
    doc = error_of(anthropic)
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert "streamed answers are off" in doc["error"]["message"]  # Anthropic's shape
    assert whole.status == 200
    assert len(worker.requests) == 1
    assert 'route="/v1/chat/completions",status="400"' in metrics  # counted like any refusal


async def test_a_refusal_names_the_caller_as_far_as_the_door_knew_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The access line of a refused request names the key once the key was checked: not for a
    wrong key, but for a bad X-Priority (refused after the key) or an unknown model."""
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER):
        async with GatewayHarness([FakeWorker()], **keyed()) as gw:
            statuses = [
                (await gw.post(CHAT, chat(), headers={"authorization": "Bearer sk-wrong"})).status,
                (await gw.post(CHAT, chat(), headers=KEY | {"x-priority": "urgent"})).status,
                (await gw.post(CHAT, chat(model="gpt-9"), headers=KEY)).status,
            ]
    logged = [
        (r.fields["status"], r.fields.get("key")) for r in caplog.records if r.name == ACCESS_LOGGER
    ]  # type: ignore[attr-defined]
    assert statuses == [401, 400, 404]
    assert logged == [(401, None), (400, "team"), (404, "team")]

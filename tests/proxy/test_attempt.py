"""Upstream attempts end through the Attempt and the request's CancelScope: the proxy against raw
asyncio workers on loopback, through the real HTTP/1.1 client, with a clock the test moves.

Deadlines are read on the test's clock, so a deadline passes only when the test moves it on (the
supervisor's timer, armed on that clock, re-checks it every few hundred milliseconds).
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from typing import Any

import orjson
import pytest

from app.accesslog import AccessLog, AccessRecord
from app.config import Settings
from app.metrics import Metrics
from app.outcomes import Outcome
from app.proxy.forward import Job, Proxy
from app.proxy.request import Route, parse_request
from app.routing.policies import RoutingContext
from app.tenants.config import TenantsConfig
from app.tenants.tenant import Tenants
from app.upstream.client import UpstreamClient
from app.workers.acceptance import CollapseDetector
from app.workers.admission import Admission
from app.workers.breaker import CircuitBreaker
from app.workers.pool import WorkerPool
from app.workers.worker import Worker, WorkerState

MODEL = "moonshotai/Kimi-K2.5"
TICK = 0.2  # the deadlines, in the test clock's seconds (and the timer's real re-check period)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class VerdictLog(CircuitBreaker):
    """A real breaker that also lists what it was told."""

    def __init__(self) -> None:
        super().__init__(failure_threshold=100)
        self.heard: list[str] = []

    def on_attempt(self) -> None:
        self.heard.append("attempt")
        super().on_attempt()

    def on_success(self) -> None:
        self.heard.append("success")
        super().on_success()

    def on_failure(self, source: str | None = None) -> None:
        self.heard.append("failure")
        super().on_failure(source)

    def on_released(self) -> None:
        self.heard.append("released")
        super().on_released()


def _event(i: int, rid: str) -> bytes:
    chunk = {
        "id": rid,  # SGLang's chunk id is the request's rid
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class RawWorker:
    """An SGLang worker at the byte level. ``mode``: ``ok`` (a whole stream), ``hang`` (reads
    the request, never answers), ``hold`` (two events, then nothing), ``503``."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.rids: list[str] = []  # completion requests, by rid
        self.aborted: list[str] = []
        self.hung_up = asyncio.Event()  # the gateway closed a completion's connection
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> RawWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = orjson.loads(await reader.readexactly(length)) if length else {}
                if path == "/abort_request":
                    self.aborted.append(body["rid"])
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                self.rids.append(body["rid"])
                if not await self._complete(reader, writer):
                    return
        finally:
            writer.close()

    async def _complete(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one completion; False when the connection is done with."""
        if self.mode == "503":
            error = b'{"object":"error","message":"busy","code":503}'
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n" % len(error)
            )
            writer.write(error)
            return True
        if self.mode == "hang":
            await reader.read()  # until the gateway hangs up
            self.hung_up.set()
            return False
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        rid = self.rids[-1]
        writer.write(_chunked(_event(0, rid)) + _chunked(_event(1, rid)))
        if self.mode == "hold":
            await reader.read()
            self.hung_up.set()
            return False
        writer.write(_chunked(_event(2, rid) + b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True


class Client:
    """The ASGI client side: what the gateway sent, and a way to leave."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.gone = asyncio.Event()
        self.committed = asyncio.Event()  # a data event arrived

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message.get("body"):
            self.body += message["body"]
            if b"data: {" in self.body:
                self.committed.set()


class Rig:
    def __init__(self, workers: list[RawWorker], **settings: Any) -> None:
        self.clock = Clock()
        self.settings = Settings(worker_urls=[w.url for w in workers], **settings)
        self.pool = WorkerPool([w.url for w in workers], clock=self.clock)
        self.breakers: dict[str, VerdictLog] = {}
        for worker in self.pool.workers:
            worker.state, worker.models = WorkerState.HEALTHY, (MODEL,)
            worker.breaker = self.breakers[worker.url] = VerdictLog()
        self.client = UpstreamClient(self.settings)
        self.metrics = Metrics()
        self.proxy = Proxy(
            settings=self.settings,
            pool=self.pool,
            policy=First(),
            client=self.client,
            metrics=self.metrics,
            access_log=AccessLog(),
            clock=self.clock,
            rng=random.Random(7),
            admission=Admission(self.settings.admission, clock=self.clock),
            acceptance=CollapseDetector(self.settings.routing, lambda: self.pool.workers),
        )

    def job(self) -> Job:
        body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        parsed = parse_request(
            orjson.dumps(body),
            Route.CHAT,
            limits=self.settings.limits,
            aliases=self.settings.model_aliases,
        )
        record = AccessRecord("req-1", Route.CHAT.value, parsed.served_model, True)
        ctx = RoutingContext(parsed.served_model, None)
        tenant = Tenants(TenantsConfig()).resolve(None)
        return Job(parsed, [], "req-1", "req-1", ctx, record, self.clock(), tenant)

    def attempts(self, worker: RawWorker, outcome: Outcome) -> float:
        labels = {"worker": f"127.0.0.1:{worker.port}", "outcome": outcome.value}
        value = self.metrics.registry.get_sample_value(
            "dflash_gateway_upstream_attempts_total", labels
        )
        return value or 0.0

    async def aclose(self) -> None:
        await self.proxy.aclose()  # the aborts sent in the background have finished
        await self.client.aclose()


class First:
    """Picks the first candidate: the workers are tried in the order given."""

    def pick(self, ctx: RoutingContext, workers: list[Worker]) -> Worker:
        return workers[0]


async def _run(rig: Rig, client: Client) -> tuple[Job, asyncio.Task[None]]:
    job = rig.job()
    task = asyncio.create_task(rig.proxy.run(job, client.receive, client.send))
    return job, task


async def _until(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), 10)


async def _poll(predicate: Any) -> None:
    async with asyncio.timeout(10):
        while not predicate():
            await asyncio.sleep(0.01)


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="dflash_gateway.access")
    return caplog


def _logged(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    (entry,) = [r for r in caplog.records if r.name == "dflash_gateway.access"]
    fields: dict[str, Any] = entry.fields  # type: ignore[attr-defined]
    return fields


async def test_first_byte_deadline_aborts_once_and_answers_504(
    access: pytest.LogCaptureFixture,
) -> None:
    async with RawWorker("hang") as slow, RawWorker("ok") as other:
        rig = Rig([slow, other], timeouts={"first_byte_s": TICK})
        client = Client()
        job, task = await _run(rig, client)
        await _poll(lambda: slow.rids)
        rig.clock.advance(2 * TICK)  # past the first-byte deadline
        await asyncio.wait_for(task, 10)
        await rig.aclose()
        await _until(slow.hung_up)  # its connection was closed, not left open

    assert client.status == 504
    assert orjson.loads(client.body)["error"]["code"] == "upstream_timeout"
    assert slow.aborted == slow.rids and len(slow.rids) == 1  # one abort, that attempt's rid
    # The worker may still be working on it: a timeout is not retried elsewhere.
    assert not other.rids
    assert rig.breakers[slow.url].heard == ["attempt", "failure"]
    assert rig.attempts(slow, Outcome.TIMEOUT) == 1
    fields = _logged(access)
    assert fields["outcome"] is Outcome.UPSTREAM_TIMEOUT and fields["status"] == 504
    assert not job.committed and rig.pool.workers[0].in_flight == 0


async def test_client_leaving_while_the_worker_is_being_connected_sends_it_nothing(
    access: pytest.LogCaptureFixture,
) -> None:
    """A worker too busy to take new connections (its accept queue full): the client leaves
    while the gateway is still connecting. The attempt stops there: its request is never written
    and no abort goes out (one sent then could reach the worker ahead of a request written after
    it, and miss it)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        # The one queued connection fills the accept queue: the gateway's connect now waits.
        with socket.create_connection(("127.0.0.1", port)):
            worker = RawWorker("hang")
            worker.port = port
            rig = Rig([worker])
            client = Client()
            _, task = await _run(rig, client)
            await _poll(lambda: rig.pool.workers[0].in_flight == 1)
            client.gone.set()
            await asyncio.wait_for(task, 10)
            await rig.aclose()

    assert not rig.metrics.registry.get_sample_value("dflash_gateway_aborts_sent_total")
    assert rig.breakers[worker.url].heard == ["attempt", "released"]  # no verdict on the worker
    fields = _logged(access)
    assert fields["outcome"] is Outcome.CLIENT_DISCONNECT and fields["status"] == 499
    assert rig.pool.workers[0].in_flight == 0


async def test_failed_attempt_is_retried_and_each_breaker_hears_one_verdict(
    access: pytest.LogCaptureFixture,
) -> None:
    async with RawWorker("503") as busy, RawWorker("ok") as good:
        rig = Rig([busy, good])
        client = Client()
        job, task = await _run(rig, client)
        await asyncio.wait_for(task, 10)
        await rig.aclose()

    assert client.status == 200 and client.body.endswith(b"data: [DONE]\n\n")
    assert len(busy.rids) == 1 and len(good.rids) == 1 and busy.rids != good.rids
    assert not busy.aborted and not good.aborted  # an error status: nothing runs there
    assert rig.breakers[busy.url].heard == ["attempt", "failure"]
    assert rig.breakers[good.url].heard == ["attempt", "success"]
    assert rig.attempts(busy, Outcome.STATUS_ERROR) == 1
    assert rig.attempts(good, Outcome.OK) == 1
    fields = _logged(access)
    assert fields["outcome"] is Outcome.OK and fields["attempts"] == 2
    assert job.committed and all(w.in_flight == 0 for w in rig.pool.workers)


async def test_client_leaving_mid_stream_aborts_once_and_is_a_499(
    access: pytest.LogCaptureFixture,
) -> None:
    async with RawWorker("hold") as worker:
        rig = Rig([worker])
        client = Client()
        _, task = await _run(rig, client)
        await _until(client.committed)
        client.gone.set()
        await asyncio.wait_for(task, 10)
        await rig.aclose()
        await _until(worker.hung_up)

    assert worker.aborted == worker.rids and len(worker.rids) == 1
    assert rig.breakers[worker.url].heard == ["attempt", "released"]  # no verdict on the worker
    assert rig.attempts(worker, Outcome.CANCELLED) == 1
    fields = _logged(access)
    assert fields["outcome"] is Outcome.CLIENT_DISCONNECT and fields["status"] == 499
    assert rig.pool.workers[0].in_flight == 0


async def test_idle_deadline_after_the_commit_point_is_an_error_event_not_a_retry(
    access: pytest.LogCaptureFixture,
) -> None:
    async with RawWorker("hold") as stalled, RawWorker("ok") as other:
        rig = Rig([stalled, other], timeouts={"idle_s": TICK})
        client = Client()
        _, task = await _run(rig, client)
        await _until(client.committed)
        rig.clock.advance(2 * TICK)
        await asyncio.wait_for(task, 10)
        await rig.aclose()

    events = client.body.split(b"\n\n")
    assert client.status == 200 and client.body.endswith(b"data: [DONE]\n\n")
    assert orjson.loads(events[-3][len(b"data: ") :])["error"]["code"] == "upstream_timeout"
    assert stalled.aborted == stalled.rids and not other.rids  # committed: never retried
    assert rig.breakers[stalled.url].heard == ["attempt", "failure"]
    assert rig.attempts(stalled, Outcome.TIMEOUT) == 1
    fields = _logged(access)
    assert fields["outcome"] is Outcome.UPSTREAM_TIMEOUT and fields["status"] == 200


async def test_total_deadline_between_attempts_is_a_504(
    access: pytest.LogCaptureFixture,
) -> None:
    async with RawWorker("503") as busy, RawWorker("ok") as other:
        # The backoff before the retry lasts far longer than the test: the total deadline ends it.
        rig = Rig(
            [busy, other],
            timeouts={"total_s": TICK},
            retry={"backoff_base_s": 60.0, "backoff_max_s": 60.0},
        )
        client = Client()
        _, task = await _run(rig, client)
        await _poll(lambda: rig.attempts(busy, Outcome.STATUS_ERROR))
        rig.clock.advance(2 * TICK)
        await asyncio.wait_for(task, 10)
        await rig.aclose()

    assert client.status == 504
    assert orjson.loads(client.body)["error"]["code"] == "upstream_timeout"
    assert not other.rids and not busy.aborted  # an error status: nothing runs there
    assert rig.breakers[busy.url].heard == ["attempt", "failure"]
    fields = _logged(access)
    assert fields["outcome"] is Outcome.UPSTREAM_TIMEOUT and fields["status"] == 504
    assert rig.metrics.registry.get_sample_value(
        "dflash_gateway_stream_outcomes_total", {"outcome": "upstream_timeout"}
    )


async def test_server_shutdown_still_cancels_and_ends_the_stream_in_band(
    access: pytest.LogCaptureFixture,
) -> None:
    async with RawWorker("hold") as worker:
        rig = Rig([worker])
        client = Client()
        _, task = await _run(rig, client)
        await _until(client.committed)
        task.cancel()  # what the server does to a request still running at shutdown
        with pytest.raises(asyncio.CancelledError):
            await task
        await rig.aclose()
        await _until(worker.hung_up)

    events = client.body.split(b"\n\n")
    assert client.body.endswith(b"data: [DONE]\n\n")
    assert orjson.loads(events[-3][len(b"data: ") :])["error"]["code"] == "service_unavailable"
    assert worker.aborted == worker.rids and len(worker.rids) == 1
    assert rig.breakers[worker.url].heard == ["attempt", "released"]
    assert _logged(access)["outcome"] is Outcome.SHUTDOWN

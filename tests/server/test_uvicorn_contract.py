"""What the gateway takes from uvicorn beyond its public API (``app/server/uvicorn/``,
``app/server/run.py``, ``app/server/metricsport.py``) is still there, by
name.

A uvicorn release that renames one of these fails here, naming it, instead of failing in
production under load. pyproject.toml pins uvicorn to the versions in ``CHECKED``: to admit a new
release, install it, run this file and the server/security tests, then widen both.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import socket
import tomllib
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from uvicorn.protocols.http import flow_control, httptools_impl
from uvicorn.server import ServerState

from app.proxy.direct import direct_body
from app.server.guard import GuardLimits, guarded_protocol
from app.server.uvicorn.protocol import HttpConnection

CHECKED = ("0.55.0",)


def _missing(obj: Any, names: list[str]) -> list[str]:
    return [name for name in names if not hasattr(obj, name)]


def _require(obj: Any, names: list[str], what: str) -> None:
    missing = _missing(obj, names)
    assert not missing, (
        f"uvicorn {uvicorn.__version__}: {what} has no {', '.join(missing)} "
        "(app/server/uvicorn/ relies on it)"
    )


def test_the_installed_uvicorn_was_checked_and_is_the_one_pinned() -> None:
    assert uvicorn.__version__ in CHECKED, (
        f"uvicorn {uvicorn.__version__} has not been checked against "
        "app/server/uvicorn/: run tests/server and tests/security with it, then add it "
        "to CHECKED and to the pin in pyproject.toml"
    )
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    (pin,) = [d for d in project["dependencies"] if d.startswith("uvicorn")]
    bounds = dict(re.findall(r"(>=|<=)([\d.]+)", pin))
    assert bounds == {">=": CHECKED[0], "<=": CHECKED[-1]}, pin


def test_the_protocol_and_request_cycle_have_what_the_adapter_uses() -> None:
    _require(httptools_impl, ["HttpToolsProtocol", "RequestResponseCycle"], "httptools_impl")
    protocol = httptools_impl.HttpToolsProtocol
    hooks = [
        "connection_made",
        "data_received",
        "connection_lost",
        "send_400_response",
        "on_message_begin",
        "on_url",
        "on_header",
        "on_headers_complete",
        "on_message_complete",
        "on_response_complete",
        # HttpConnection.on_response_complete, which replaces uvicorn's keep-alive handling
        "_unset_keepalive_if_required",
        "_start_asgi_task",
        "timeout_keep_alive_handler",
    ]
    _require(protocol, hooks, "HttpToolsProtocol")
    # uvicorn's own response end (its keep-alive timer and pipelining), which the adapter's
    # replaces: a change in it is a change to review there.
    source = inspect.getsource(protocol.on_response_complete)
    for line in (
        "self.server_state.total_requests += 1",
        "self.flow.resume_reading()",
        "cycle, app = self.pipeline.pop()",
        "self._start_asgi_task(cycle, app)",
        "self.timeout_keep_alive, self.timeout_keep_alive_handler",
    ):
        assert line in source, f"uvicorn's on_response_complete changed: {line!r} is gone"
    params = list(inspect.signature(protocol.__init__).parameters)
    assert params[:4] == ["self", "config", "server_state", "app_state"], params

    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(_app, http=HttpConnection)
        config.load()
        conn = HttpConnection(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        fields = ["transport", "flow", "cycle", "scope", "connections", "client", "loop"]
        fields += ["pipeline", "parser", "server_state", "timeout_keep_alive"]
        fields += ["timeout_keep_alive_task"]
        _require(conn, fields, "an HttpToolsProtocol instance")
        conn.on_message_begin()
        _require(conn, ["url"], "an HttpToolsProtocol instance after on_message_begin")
    finally:
        loop.close()

    cycle_params = set(inspect.signature(httptools_impl.RequestResponseCycle).parameters)
    cycle = httptools_impl.RequestResponseCycle(
        **{name: None for name in cycle_params if name != "message_event"},
        message_event=asyncio.Event(),
    )
    fields = [
        "scope",
        "transport",
        "flow",
        "disconnected",
        "keep_alive",
        "response_started",
        "response_complete",
        "chunked_encoding",
        "message_event",
        # ResponseLane.respond: a whole response written as ``send`` would
        "access_log",
        "default_headers",
        "waiting_for_100_continue",
        "expected_content_length",
        "on_response",
    ]
    _require(cycle, fields, "a RequestResponseCycle")
    _require(httptools_impl, ["STATUS_LINE"], "httptools_impl")
    _require(flow_control.FlowControl, ["drain", "pause_reading", "resume_reading"], "FlowControl")
    flow = flow_control.FlowControl(None)  # type: ignore[arg-type]
    _require(flow, ["write_paused"], "a FlowControl instance")


def test_the_server_has_what_the_gateway_overrides() -> None:
    server = uvicorn.Server(uvicorn.Config(_app))
    _require(server, ["started", "should_exit", "handle_exit", "capture_signals"], "Server")
    assert "sockets" in inspect.signature(server.serve).parameters


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Streams two chunks: one through ``send``, one through the direct lane if offered."""
    if scope["type"] != "http":
        return
    lane = direct_body(scope)
    assert lane is not None, "the guarded protocol offered no direct lane"
    assert not lane.ready()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    assert lane.ready(), "a chunked response was started but the lane is not ready"
    await send({"type": "http.response.body", "body": b"one;", "more_body": True})
    lane.write(b"two;")
    await lane.drain()
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_the_direct_lane_writes_into_a_real_uvicorn_response() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    protocol = guarded_protocol(GuardLimits(header_s=5, body_s=5, max_header_bytes=4096))
    config = uvicorn.Config(_app, http=protocol, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/", timeout=10)
    finally:
        server.should_exit = True
        await task
        sock.close()
    assert response.status_code == 200
    assert response.content == b"one;two;"


async def _started_on_the_lane(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A stream whose head and first chunk go out in one lane write, then one more chunk on
    the lane, and its last chunk with the end through ``send``."""
    if scope["type"] != "http":
        return
    lane = direct_body(scope)
    assert lane is not None
    head = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"r1")]
    assert lane.start_stream(200, head, b"one;")
    assert lane.ready(), "the lane's stream start left the cycle unstarted"
    lane.write(b"two;")
    await send({"type": "http.response.body", "body": b"three;", "more_body": False})


async def test_a_stream_started_on_the_lane_is_one_uvicorn_would_have_sent() -> None:
    """Head and first chunk in one write leave uvicorn's cycle as its two sends would: the
    chunks and the end frame right, and the connection kept alive for the next request."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    protocol = guarded_protocol(GuardLimits(header_s=5, body_s=5, max_header_bytes=4096))
    config = uvicorn.Config(
        _started_on_the_lane, http=protocol, lifespan="off", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    responses = []
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
            for _ in range(2):  # the second one on the same connection
                responses.append(await client.get(f"http://127.0.0.1:{port}/", timeout=10))
    finally:
        server.should_exit = True
        await task
        sock.close()
    for response in responses:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["x-request-id"] == "r1"
        assert response.content == b"one;two;three;"
    assert responses[0].extensions["network_stream"] is responses[1].extensions["network_stream"]


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


async def test_keep_alive_counts_from_the_last_response_and_closes_an_idle_connection() -> None:
    """One keep-alive timer per connection instead of one per response: a connection that
    answered again since it was armed stays open past the first timeout, and one left idle is
    closed once the timeout has passed since its last response."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    protocol = guarded_protocol(GuardLimits(header_s=5, body_s=5, max_header_bytes=4096))
    config = uvicorn.Config(
        _hello, http=protocol, lifespan="off", log_config=None, timeout_keep_alive=1
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        for pause in (0.0, 0.6, 0.7):  # the last request comes 1.3 s after the first answer
            await asyncio.sleep(pause)
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\nok"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
        answered = loop.time()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed: idle past the timeout
        assert loop.time() - answered >= 0.9
        writer.close()
    finally:
        server.should_exit = True
        await task
        sock.close()

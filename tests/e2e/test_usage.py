"""Per-key token counters and the usage log, end to end: an emulated worker and gateways with a
keys file and a usage log, as real processes on loopback.

- after chat and text completions (streamed and not, thinking on and off) with two keys,
  ``/metrics`` holds each key's prompt, completion and reasoning tokens equal to the sums of the
  ``usage`` its clients received, and no key label but the configured names;
- at shutdown (SIGTERM) the usage log holds one line per request of a known key, the door's
  refusals included with zero tokens, with the tokens the client saw; a 401 has no line;
- lines queued while the disk is stuck are written out at SIGTERM; past the queue bound they are
  dropped and counted in ``/metrics``, and requests are answered all the same;
- with ``--processes 2`` each process writes its own file.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import emulator
from tests.support.procs import PYTHON, ManagedProcess, ProcessManager, managed_processes

KEYS = {"team-a": "team-a-secret-0123456789", "team-b": "team-b-secret-0123456789"}
OPS = {"authorization": f"Bearer {KEYS['team-b']}"}  # keys are configured: /metrics needs one
UNKNOWN = "not-a-configured-key-0123"
MODEL = "kimi-k2.5"


@dataclass
class Sent:
    request_id: str
    key: str | None
    status: int
    stream: bool
    usage: dict[str, int] = field(default_factory=dict)


def start_gateway(
    procs: ProcessManager, emu: ManagedProcess, tmp: Path, usage_log: Path, *extra: str, **env: str
) -> ManagedProcess:
    keys_file = tmp / "keys"
    keys_file.write_text("".join(f"{name}:{secret}\n" for name, secret in KEYS.items()))
    argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", "--worker-url", emu.url, *extra]
    return procs.start(
        argv,
        name="gateway",
        ready_path="/readyz",
        ready_status=200,
        env={
            "DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.3",
            "DFLASH_GATEWAY_AUTH__KEYS_FILE": str(keys_file),
            "DFLASH_GATEWAY_TENANTS__USAGE_LOG": str(usage_log),
            "DFLASH_GATEWAY_DRAIN_ACCEPT_S": "0",
            "DFLASH_GATEWAY_DRAIN_S": "5",
            **env,
        },
    )


def _usage_of_stream(body: bytes) -> dict[str, int]:
    events = [e[6:] for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert body.rstrip().endswith(b"data: [DONE]")
    return dict(orjson.loads(events[-1])["usage"])


def _tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"], usage.get("reasoning_tokens") or 0


def send(
    client: httpx.Client,
    url: str,
    key: str | None,
    *,
    chat: bool = True,
    stream: bool = False,
    thinking: bool = True,
    headers: dict[str, str] | None = None,
    model: str = MODEL,
) -> Sent:
    body: dict[str, Any] = {"model": model, "max_tokens": 60}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Question {os.urandom(4).hex()}"}]
        if not thinking:
            body["chat_template_kwargs"] = {"thinking": False}
    else:
        body["prompt"] = f"Say {os.urandom(4).hex()}"
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    sent_headers = dict(headers or {})
    secret = KEYS.get(key or "", key)
    if secret is not None:
        sent_headers["Authorization"] = f"Bearer {secret}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = client.post(url + path, json=body, headers=sent_headers)
    name = key if key in KEYS else None
    sent = Sent(response.headers["x-request-id"], name, response.status_code, stream)
    if response.status_code == 200:
        sent.usage = _usage_of_stream(response.content) if stream else response.json()["usage"]
    return sent


def traffic(url: str) -> list[Sent]:
    """Both keys, different mixes; then refusals at the door (known key) and two 401s."""
    out: list[Sent] = []
    with httpx.Client(timeout=60) as client:
        for key, rounds in (("team-a", 3), ("team-b", 2)):
            for i in range(rounds):
                for stream in (False, True):
                    out.append(send(client, url, key, stream=stream, thinking=i % 2 == 0))
                    out.append(send(client, url, key, chat=False, stream=stream))
        out.append(send(client, url, "team-a", headers={"X-Priority": "urgent"}))  # 400
        out.append(send(client, url, "team-b", model="no-such-model"))  # 404
        out.append(send(client, url, UNKNOWN))  # 401
        out.append(send(client, url, None))  # 401
    return out


def read_lines(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def metric_values(text: str, name: str) -> dict[str, float]:
    """``{label set: value}`` of one metric family in Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name) :]] = float(value)
    return out


def terminate(proc: ManagedProcess, timeout: float = 20) -> int:
    assert proc.popen is not None
    proc.popen.send_signal(signal.SIGTERM)
    return proc.popen.wait(timeout=timeout)


@dataclass
class Run:
    sent: list[Sent]
    metrics: str
    lines: list[dict[str, Any]]
    exit_code: int


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with managed_processes(tmp_path_factory, "usage") as procs:
        tmp = procs.log_dir
        emu = emulator(procs, "emu", "--seed", "3")
        path = tmp / "usage.jsonl"
        gw = start_gateway(procs, emu, tmp, path)
        sent = traffic(gw.url)
        metrics = httpx.get(gw.url + "/metrics", headers=OPS, timeout=10).text
        code = terminate(gw)
        yield Run(sent, metrics, read_lines(path), code)


def test_traffic_was_served(run: Run) -> None:
    statuses = [s.status for s in run.sent]
    assert statuses.count(200) == 20
    assert statuses[20:] == [400, 404, 401, 401]
    assert all(s.usage["completion_tokens"] > 0 for s in run.sent if s.status == 200)
    # Thinking on: the worker reports reasoning tokens, streamed and not.
    assert any(s.usage.get("reasoning_tokens") for s in run.sent if s.stream)
    assert any(s.usage.get("reasoning_tokens") for s in run.sent if not s.stream)


def test_key_token_counters_are_the_sums_the_clients_received(run: Run) -> None:
    expected: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for s in run.sent:
        if s.status == 200:
            assert s.key is not None
            for i, n in enumerate(_tokens(s.usage)):
                expected[s.key][i] += n
    assert all(v[2] > 0 for v in expected.values())
    for i, kind in enumerate(("prompt", "completion", "reasoning")):
        got = metric_values(run.metrics, f"dflash_gateway_key_{kind}_tokens_total")
        assert got == {f'{{key="{k}"}}': float(v[i]) for k, v in expected.items()}, kind


def test_only_configured_key_names_are_labels(run: Run) -> None:
    labelled = [line for line in run.metrics.splitlines() if 'key="' in line]
    assert labelled
    names = {line.split('key="', 1)[1].split('"', 1)[0] for line in labelled}
    assert names == set(KEYS)
    assert "not-a-configured" not in run.metrics


def test_the_usage_log_has_a_line_per_request_of_a_known_key(run: Run) -> None:
    assert run.exit_code == 0
    by_id = {line["request_id"]: line for line in run.lines}
    assert len(by_id) == len(run.lines)
    billable = [s for s in run.sent if s.key is not None]
    assert set(by_id) == {s.request_id for s in billable}  # the 401s have none
    for s in billable:
        line = by_id[s.request_id]
        assert line["key"] == s.key and line["status"] == s.status and line["stream"] is s.stream
        tokens = (line["prompt_tokens"], line["completion_tokens"], line["reasoning_tokens"])
        if s.status == 200:
            assert tokens == _tokens(s.usage)
            assert line["outcome"] == "ok" and line["worker"] and line["attempts"] == 1
            assert line["priority"] == "normal" and line["model"] == "moonshotai/Kimi-K2.5"
            assert line["duration_ms"] > 0
            if line["route"] == "/v1/chat/completions":  # text completions: when known
                assert line["accept_length"] > 1
            assert (line["ttft_ms"] is not None) is s.stream
        else:
            assert tokens == (0, 0, 0) and line["outcome"] == "rejected"
        assert line["time"].endswith("Z")


def test_a_stuck_disk_drops_and_counts_and_what_is_queued_is_written_at_sigterm(
    procs: ProcessManager, tmp_path: Path
) -> None:
    """The usage log is a FIFO nobody reads yet (a disk that hangs): every request is answered,
    lines past the queue bound are counted as dropped, and after SIGTERM the queued ones come
    out before the process exits."""
    emu = emulator(procs, "emu", "--seed", "4")
    fifo = tmp_path / "usage.fifo"
    os.mkfifo(fifo)
    gw = start_gateway(procs, emu, tmp_path, fifo, DFLASH_GATEWAY_TENANTS__USAGE_LOG_QUEUE="4")
    with httpx.Client(timeout=60) as client:
        sent = [send(client, gw.url, "team-a", stream=i % 2 == 1) for i in range(12)]
    assert [s.status for s in sent] == [200] * 12
    metrics = httpx.get(gw.url + "/metrics", headers=OPS, timeout=10).text
    dropped = _plain(metrics, "dflash_gateway_usage_log_dropped_lines_total")
    assert dropped >= 4  # at most one batch taken and 4 waiting

    opened: list[int] = []
    reader = threading.Thread(target=lambda: opened.append(os.open(fifo, os.O_RDONLY)))
    reader.start()
    assert gw.popen is not None
    gw.popen.send_signal(signal.SIGTERM)
    reader.join(timeout=20)
    if not opened:  # the gateway never opened it: unblock the reader thread, then fail
        os.close(os.open(fifo, os.O_WRONLY))
        reader.join()
        pytest.fail("the gateway exited without writing its queued usage lines")
    data = b""
    while chunk := os.read(opened[0], 1 << 16):
        data += chunk
    os.close(opened[0])
    assert gw.popen.wait(timeout=20) == 0
    lines = [orjson.loads(line) for line in data.splitlines()]
    assert len(lines) + dropped == 12
    assert {line["request_id"] for line in lines} <= {s.request_id for s in sent}


def _plain(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_each_gateway_process_writes_its_own_file(procs: ProcessManager, tmp_path: Path) -> None:
    emu = emulator(procs, "emu", "--seed", "5")
    logs = tmp_path / "logs"
    logs.mkdir()
    gw = start_gateway(procs, emu, tmp_path, logs / "usage.jsonl", "--processes", "2")
    with httpx.Client(timeout=60) as client:
        sent = []
        for i in range(24):
            client.headers["connection"] = "close"  # a new connection each: both processes serve
            sent.append(send(client, gw.url, "team-b", stream=i % 2 == 1))
    assert [s.status for s in sent] == [200] * 24
    assert terminate(gw, timeout=30) == 0
    assert sorted(p.name for p in logs.iterdir()) == ["usage.0.jsonl", "usage.1.jsonl"]
    lines = read_lines(logs / "usage.0.jsonl") + read_lines(logs / "usage.1.jsonl")
    assert sorted(line["request_id"] for line in lines) == sorted(s.request_id for s in sent)
    by_id = {s.request_id: s for s in sent}
    for line in lines:
        s = by_id[line["request_id"]]
        assert (line["prompt_tokens"], line["completion_tokens"]) == _tokens(s.usage)[:2]


def test_a_clients_x_request_id_never_becomes_the_records_id(
    procs: ProcessManager, tmp_path: Path
) -> None:
    """Clients that all send ``X-Request-Id: same`` (once, twice, or with bytes a log must not
    take as they are) each get a line of their own: its ``request_id`` the gateway's, unique, the
    access line's; the client's value beside it as ``client_request_id``, escaped and capped. A
    billing job de-duplicating by ``request_id`` counts every request. The client still gets its
    own sane id back (and the worker is sent it); an unusable one gets the gateway's id back."""
    emu = emulator(procs, "emu", "--seed", "3")
    path = tmp_path / "usage.jsonl"
    gw = start_gateway(procs, emu, tmp_path, path, DFLASH_GATEWAY_LOG_JSON="1")
    hostile = 'a "b"\t\xff' + "x" * 300  # spaces, quotes, a tab, a non-ASCII byte
    sent: list[tuple[str, str]] = []  # (the response's X-Request-Id, what the client sent)
    with httpx.Client(timeout=60) as client:
        for stream in (False, True, False):
            sent.append(
                (
                    send(
                        client, gw.url, "team-a", stream=stream, headers={"X-Request-Id": "same"}
                    ).request_id,
                    "same",
                )
            )
        twice = [
            ("authorization", f"Bearer {KEYS['team-b']}"),
            ("x-request-id", "same"),
            ("x-request-id", "other"),
        ]
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        response = client.post(gw.url + "/v1/chat/completions", json=body, headers=twice)
        assert response.status_code == 200
        sent.append((response.headers["x-request-id"], "same"))
        refused = client.post(
            gw.url + "/v1/chat/completions",
            json={**body, "model": "nope"},
            headers={**dict(twice[:1]), "x-request-id": hostile.encode("latin-1")},
        )
        assert refused.status_code == 404
        sent.append((refused.headers["x-request-id"], hostile))
    access = {}
    for line in gw.logs().splitlines():
        if line.startswith("{") and '"dflash_gateway.access"' in line:
            doc = orjson.loads(line)
            access[doc["request_id"]] = doc
    assert terminate(gw) == 0
    lines = read_lines(path)
    ids = [line["request_id"] for line in lines]
    assert [echoed for echoed, _ in sent] == ["same"] * 4 + [ids[4]]
    assert len(set(ids)) == len(ids) and "same" not in ids
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert [line["client_request_id"] for line in lines[:4]] == ["same"] * 4
    escaped = lines[4]["client_request_id"]
    assert escaped.startswith("a\\x20\\x22b\\x22\\x09\\xffxxx") and len(escaped) <= 200
    for line in lines:
        assert access[line["request_id"]]["client_request_id"] == line["client_request_id"]
    # The worker was sent the id the client got back.
    seen = [r["request_id"] for r in httpx.get(emu.url + "/emulator/stats").json()["requests"]]
    assert seen.count("same") == 4 and not set(ids) & set(seen)

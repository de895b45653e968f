"""Bad input against a real gateway: never a 5xx, never a hang, every answer OpenAI-shaped.

A hand-written set (invalid JSON, wrong types, huge strings, deep nesting, invalid UTF-8, missing
fields, negative/huge max_tokens, unknown roles...) and schemathesis, driven by the gateway's own
``/openapi.json``, over both completion endpoints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.security.stack import MODEL, emulator, error_of, start_gateway
from tests.support.procs import ManagedProcess, managed_processes

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY = 64 * 1024
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with managed_processes(tmp_path_factory, "fuzz") as manager:
        emu = emulator(manager, "emu", "--speed", "100")
        yield start_gateway(
            manager,
            [emu],
            env={
                "DFLASH_GATEWAY_LIMITS__MAX_BODY_BYTES": str(MAX_BODY),
                "DFLASH_GATEWAY_LIMITS__MAX_TOKENS_CAP": "8",
                "DFLASH_GATEWAY_LIMITS__DEFAULT_MAX_TOKENS": "8",
                "DFLASH_GATEWAY_LIMITS__MAX_MESSAGES": "64",
            },
        )


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _body(**fields: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": MSG, **fields})


OVER_LIMIT = _body(messages=[{"role": "user", "content": "x" * MAX_BODY}])
DEEP_IN_CONTENT = _body()[:-3] + b', "x": ' + _nested(300) + b"}]}"
DEEP_WITH_PATCH = _body(max_tokens=10**9)[:-1] + b', "x": ' + _nested(300) + b"}"
DEEP_AFFINITY = (
    orjson.dumps({"model": MODEL})[:-1]
    + b', "messages": [{"role": "user", "content": '
    + _nested(300)
    + b"}]}"
)
DUPLICATE_KEYS = b'{"model": 1, "model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % (
    MODEL.encode()
)

# (name, path, raw body, expected status or None = "any non-5xx")
CASES: list[tuple[str, str, bytes, int | None]] = [
    ("empty body", CHAT, b"", 400),
    ("truncated json", CHAT, b'{"model": "m", "messages": [', 400),
    ("not json", CHAT, b"model=m&messages=hi", 400),
    ("null bytes", CHAT, b"\x00\x01\x02", 400),
    ("json array", CHAT, b"[1, 2, 3]", 400),
    ("json string", CHAT, b'"hello"', 400),
    ("json null", CHAT, b"null", 400),
    ("invalid utf-8 in a string", CHAT, b'{"model": "\xff\xfe", "messages": []}', 400),
    ("invalid utf-8 in content", CHAT, _body()[:-3] + b'"\xc3\x28"}]}', 400),
    ("lone surrogate escape", CHAT, _body(user="\\ud800").replace(b"\\\\", b"\\"), None),
    ("missing everything", CHAT, b"{}", 400),
    ("missing messages", CHAT, orjson.dumps({"model": MODEL}), 400),
    ("missing model", CHAT, orjson.dumps({"messages": MSG}), 400),
    ("missing prompt", COMPLETIONS, orjson.dumps({"model": MODEL}), 400),
    ("model is a number", CHAT, _body(model=5), 400),
    ("model is empty", CHAT, _body(model=""), 400),
    ("unknown model", CHAT, _body(model="gpt-nope"), 404),
    ("messages is an object", CHAT, _body(messages={"role": "user"}), 400),
    ("messages is empty", CHAT, _body(messages=[]), 400),
    ("message is a string", CHAT, _body(messages=["hi"]), 400),
    ("too many messages", CHAT, _body(messages=MSG * 65), 400),
    ("unknown role", CHAT, _body(messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("role is a number", CHAT, _body(messages=[{"role": 5, "content": "hi"}]), 400),
    ("role is a list", CHAT, _body(messages=[{"role": [], "content": "hi"}]), 400),
    ("content is a number", CHAT, _body(messages=[{"role": "user", "content": 5}]), 400),
    ("stream is a string", CHAT, _body(stream="yes"), 400),
    ("stream_options is a list", CHAT, _body(stream=True, stream_options=[]), 400),
    ("user is a number", CHAT, _body(user=5), 400),
    ("prompt is a number", COMPLETIONS, orjson.dumps({"model": MODEL, "prompt": 5}), 400),
    ("max_tokens negative", CHAT, _body(max_tokens=-1), 400),
    ("max_tokens zero", CHAT, _body(max_tokens=0), 400),
    ("max_tokens float", CHAT, _body(max_tokens=1.5), 400),
    ("max_tokens string", CHAT, _body(max_tokens="9"), 400),
    ("max_tokens bool", CHAT, _body(max_tokens=True), 400),
    ("max_tokens beyond int64", CHAT, _body()[:-1] + b', "max_tokens": 1' + b"0" * 30 + b"}", 400),
    ("max_tokens huge: clamped", CHAT, _body(max_tokens=2**62), 200),
    ("max_completion_tokens negative", CHAT, _body(max_completion_tokens=-5), 400),
    ("temperature wrong type (worker's 400)", CHAT, _body(temperature="hot"), 400),
    ("huge model name", CHAT, _body(model="m" * 60_000), 404),
    ("body over the limit", CHAT, OVER_LIMIT, 413),
    ("nested 300 deep in content", CHAT, DEEP_IN_CONTENT, None),
    ("nested 300 deep with a patched key", CHAT, DEEP_WITH_PATCH, None),
    ("nested 300 deep, affinity hash", CHAT, DEEP_AFFINITY, None),
    ("nested 5000 deep", CHAT, b'{"model": "m", "messages": ' + _nested(5000) + b"}", 400),
    ("duplicate keys", CHAT, DUPLICATE_KEYS, 200),
    ("unknown fields are dropped", CHAT, _body(frobnicate={"a": [1, 2]}, n=1), 200),
    ("denied field", CHAT, _body(custom_logit_processor="x"), 400),
    ("n too large", CHAT, _body(n=100000), 400),
    ("stream ok", CHAT, _body(stream=True), 200),
    ("completions ok", COMPLETIONS, orjson.dumps({"model": MODEL, "prompt": "hi"}), 200),
]  # fmt: skip


@pytest.mark.parametrize(("name", "path", "raw", "expected"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_cleanly(
    gw: ManagedProcess, name: str, path: str, raw: bytes, expected: int | None
) -> None:
    response = httpx.post(
        gw.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code < 500, response.text[:500]
    if expected is not None:
        assert response.status_code == expected, response.text[:500]
    _check_shape(response)


def _check_shape(response: httpx.Response) -> None:
    assert response.headers["x-request-id"]
    if response.status_code >= 400:
        error = error_of(response)
        assert isinstance(error["message"], str)
        assert "Traceback" not in response.text
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        return
    assert response.json()["choices"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", CHAT, 405),
        ("PUT", COMPLETIONS, 405),
        ("POST", "/v1/nope", 404),
        ("GET", "/v1/", 404),
        ("DELETE", "/v1/models", 405),
    ],
)
def test_wrong_routes_and_methods(gw: ManagedProcess, method: str, path: str, status: int) -> None:
    response = httpx.request(method, gw.url + path, timeout=10)
    assert response.status_code == status
    _check_shape(response)


def test_schemathesis_finds_no_server_error(gw: ManagedProcess, tmp_path: Path) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.fail("schemathesis is not installed (it is in the project's test extra)")
    report = tmp_path / "junit.xml"
    # Refused before the body is looked at: over the size limit (413), not JSON (415).
    (tmp_path / "schemathesis.toml").write_text(
        "[checks.negative_data_rejection]\nexpected-statuses = [400, 401, 404, 413, 415, 429]\n"
    )
    result = subprocess.run(
        [
            st,
            "run",
            gw.url + "/openapi.json",
            "--checks",
            "not_a_server_error,status_code_conformance,content_type_conformance,"
            "response_schema_conformance,negative_data_rejection",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            os.environ.get("FUZZ_MAX_EXAMPLES", "40"),  # more for a deeper run, by hand
            "--seed",
            os.environ.get("FUZZ_SEED", "1"),
            "--request-timeout",
            "30",
            "--report",
            "junit",
            "--report-junit-path",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,  # schemathesis keeps its example database in the working directory
    )
    out = result.stdout
    print(out[-2000:])
    failures = out[out.find("FAILURES") :] if "FAILURES" in out else out[-6000:]
    assert result.returncode == 0, failures[:12000] + result.stderr[-2000:]

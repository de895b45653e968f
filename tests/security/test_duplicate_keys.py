"""Repeated keys in one JSON object, seen from the worker: one real gateway process in front of a
recording stand-in worker (tests/security/recorder.py).

JSON leaves a repeated key to the parser. The gateway's (msgspec, orjson) and an SGLang worker's
(Python's ``json`` behind FastAPI, pydantic) each keep the LAST value, so the gateway must police
the last one too: every body here writes an allowed value first and a refused one after it (a
media URL the policy refuses, a client chat template), in plain and ``\\uXXXX``-escaped spellings,
at every level where the gateway looks: the top level, a message, a content part, its ``url``, a
Messages image source, a Responses ``input_image``. Whatever the gateway answers, it is not a
5xx, and what the worker decodes (Python's ``json``, as SGLang does) holds no poisoned value.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.security.recorder import MODEL, RecordingWorker, recording_worker
from tests.security.stack import CHAT, start_gateway
from tests.support.procs import ManagedProcess, managed_processes

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
POISON = "POISON"
OK = b"https://example.com/cat.png"
BAD_URLS = [
    b"https://169.254.169.254/POISON",
    b"file:///etc/POISON",
    b"https:\\/\\/169.254.169.254/POISON",  # escaped slashes
    b"\\u0066ile:///etc/POISON",  # escaped scheme
    b"https://[::ffff:a9fe:a9fe]/POISON",
    b"https://0xa9.0xfe.0xa9.0xfe/POISON",
    b"https://kubernetes.default./POISON",
]
M = MODEL.encode()


def _chat(content: bytes, *, top: bytes = b"") -> bytes:
    return b'{"model":"%s","max_tokens":4%s,"messages":[{"role":"user","content":%s}]}' % (
        M,
        top,
        content,
    )


def _parts(part: bytes) -> bytes:
    return b'[{"type":"text","text":"What is this?"},%s]' % part


def _chat_bodies(url: bytes) -> list[bytes]:
    img = b'{"type":"image_url","image_url":{"url":"%s"}}'
    return [
        # the part's url, twice
        _chat(_parts(b'{"type":"image_url","image_url":{"url":"%s","url":"%s"}}' % (OK, url))),
        _chat(
            _parts(b'{"type":"image_url","image_url":{"url":"%s","\\u0075rl":"%s"}}' % (OK, url))
        ),
        # the part's media key, twice (plain, escaped, and a string value after an object)
        _chat(
            _parts(
                b'{"type":"image_url","image_url":{"url":"%s"},"image_url":{"url":"%s"}}'
                % (OK, url)
            )
        ),
        _chat(
            _parts(
                b'{"type":"image_url","image_url":{"url":"%s"},"image\\u005furl":{"url":"%s"}}'
                % (OK, url)
            )
        ),
        _chat(
            _parts(b'{"type":"video_url","video_url":{"url":"%s"},"video_url":"%s"}' % (OK, url))
        ),
        # a message's content, twice: a string first, the media part after it
        _chat(b'"hi","content":' + _parts(img % url)),
        _chat(b'"hi","c\\u006fntent":' + _parts(img % url)),
        # the whole messages array, twice
        b'{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"messages":'
        b'[{"role":"user","content":%s}]}' % (M, _parts(img % url)),
        # the same, with a field the gateway drops and one whose first value is ill-typed (the
        # gateway reads such bodies again, field by field)
        b'{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"x_unknown":1,'
        b'"messages":[{"role":"user","content":%s}]}' % (M, _parts(img % url)),
        b'{"model":"%s","stream":"no","max_tokens":4,"messages":[{"role":"user","content":"hi"}],'
        b'"stream":false,"messages":[{"role":"user","content":%s}]}' % (M, _parts(img % url)),
        # a tool message's parts
        b'{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":"hi"},{"role":"tool",'
        b'"tool_call_id":"a","content":%s}]}'
        % (M, _parts(b'{"type":"image_url","image_url":{"url":"%s","url":"%s"}}' % (OK, url))),
    ]


def _messages_bodies(url: bytes) -> list[tuple[str, bytes]]:
    image = (
        b'{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":'
        b'[{"type":"image","source":%s}]}]}'
    )
    sources = [
        b'{"type":"url","url":"%s","url":"%s"}' % (OK, url),
        b'{"type":"url","url":"%s","\\u0075rl":"%s"}' % (OK, url),
        b'{"type":"base64","media_type":"image/png","data":"aGk=","type":"url","url":"%s"}' % url,
    ]
    bodies = [(MESSAGES, image % (M, source)) for source in sources]
    count = b'{"model":"%s","messages":[{"role":"user","content":[{"type":"image","source":%s}]}]}'
    return bodies + [(COUNT, count % (M, source)) for source in sources]


def _responses_bodies(url: bytes) -> list[bytes]:
    body = (
        b'{"model":"%s","max_output_tokens":4,"store":false,"input":[{"role":"user","content":'
        b'[{"type":"input_text","text":"What is this?"},%s]}]}'
    )
    return [
        body % (M, b'{"type":"input_image","image_url":"%s","image_url":"%s"}' % (OK, url)),
        body % (M, b'{"type":"input_image","image_url":"%s","image\\u005furl":"%s"}' % (OK, url)),
    ]


TEMPLATE_KWARGS = [
    b',"chat_template_kwargs":{"thinking":true},"chat_template_kwargs":{"chat_template":"{{POISON}}"}',
    b',"chat_template_kwargs":{"thinking":true},"chat\\u005ftemplate_kwargs":{"chat_template":"{{POISON}}"}',
    b',"chat_template_kwargs":{"thinking":true,"chat\\u005ftemplate":"{{POISON}}"}',
    b',"chat_template_kwargs":{"thinking":true},"x_unknown":1,"chat_template_kwargs":{"POISON":1}',
    b',"stream":"no","chat_template_kwargs":{"thinking":true},"stream":false,"chat_template_kwargs":{"POISON":1}',
    b',"chat_template_kwargs":null,"chat_template_kwargs":{"tokenize":true,"POISON":1}',
]  # fmt: skip


@dataclass
class Stack:
    gw: ManagedProcess
    worker: RecordingWorker

    def poisoned(self, path: str, body: bytes) -> list[str]:
        """Post ``body``; the bodies the worker received for it that hold a poisoned value once
        decoded as the worker decodes them."""
        before = len(self.worker.bodies)
        headers = {"content-type": "application/json", "x-api-key": "unused"}
        response = httpx.post(self.gw.url + path, content=body, headers=headers, timeout=30)
        assert response.status_code < 500, response.text[:400]
        sent = [json.dumps(json.loads(b)) for b in self.worker.bodies[before:]]
        return [s[:300] for s in sent if POISON in s]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with recording_worker() as worker, managed_processes(tmp_path_factory, "dupkeys") as procs:
        yield Stack(start_gateway(procs, [], args=("--worker-url", worker.url)), worker)


@pytest.mark.parametrize("url", BAD_URLS, ids=range(len(BAD_URLS)))
def test_a_repeated_key_cannot_slip_a_media_url_past_the_policy(stack: Stack, url: bytes) -> None:
    cases = [(CHAT, body) for body in _chat_bodies(url)]
    cases += _messages_bodies(url)
    cases += [(RESPONSES, body) for body in _responses_bodies(url)]
    leaked = [(path, body, stack.poisoned(path, body)) for path, body in cases]
    assert [case for case in leaked if case[2]] == []


@pytest.mark.parametrize("extra", TEMPLATE_KWARGS, ids=range(len(TEMPLATE_KWARGS)))
def test_a_repeated_key_cannot_slip_template_kwargs_past_the_allow_list(
    stack: Stack, extra: bytes
) -> None:
    body = b'{"model":"%s","max_tokens":4,"messages":[{"role":"user","content":"hi"}]%s}' % (
        M,
        extra,
    )
    assert stack.poisoned(CHAT, body) == []


def test_the_allowed_value_after_a_refused_one_is_served(stack: Stack) -> None:
    """The last value counts both ways: a refused URL followed by an allowed one reaches the
    worker as the allowed one (nothing is refused that the worker would not fetch)."""
    before = len(stack.worker.bodies)
    part = b'{"type":"image_url","image_url":{"url":"file:///etc/POISON","url":"%s"}}' % OK
    headers = {"content-type": "application/json", "x-api-key": "unused"}
    response = httpx.post(
        stack.gw.url + CHAT, content=_chat(_parts(part)), headers=headers, timeout=30
    )
    assert response.status_code == 200, response.text[:400]
    (sent,) = stack.worker.bodies[before:]
    assert json.loads(sent)["messages"][0]["content"][1]["image_url"] == {"url": OK.decode()}

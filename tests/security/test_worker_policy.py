"""What a client can make a worker fetch, render or run, seen from the worker: one real gateway
process for the module in front of a recording stand-in worker (tests/security/recorder.py) that
keeps the exact bytes it was sent. Each refusal is a 400 naming the field, and the worker never
receives the refused body (nor any piece of it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests.security.recorder import MODEL, RecordingWorker, recording_worker
from tests.security.stack import CHAT, error_of, start_gateway
from tests.support.procs import ManagedProcess, managed_processes

COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"


@dataclass
class Stack:
    gw: ManagedProcess
    worker: RecordingWorker

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = {"content-type": "application/json", "x-api-key": "unused"}
        return httpx.post(self.gw.url + path, content=content, headers=headers, timeout=30)

    def refused(self, path: str, body: Any, secret: bytes) -> dict[str, Any]:
        """Post ``body``: a 400 whose error is returned; nothing new, and nothing holding
        ``secret``, reached the worker."""
        before = len(self.worker.bodies)
        response = self.post(path, body)
        assert response.status_code == 400, response.text[:400]
        assert len(self.worker.bodies) == before, self.worker.bodies[before:]
        assert not any(secret in sent for sent in self.worker.bodies)
        doc = response.json()
        return doc["error"] if path == MESSAGES else error_of(response)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with recording_worker() as worker, managed_processes(tmp_path_factory, "policy") as procs:
        yield Stack(start_gateway(procs, [], args=("--worker-url", worker.url)), worker)


def _chat_with(part: bytes, *, before: bytes = b"") -> bytes:
    """A chat body whose user turn holds a text part and ``part`` (raw JSON, as written)."""
    return (
        b'{"model":"%s","max_tokens":4,"messages":[%s{"role":"user","content":'
        b'[{"type":"text","text":"What is this?\\nSay."},%s]}]}' % (MODEL.encode(), before, part)
    )


# Media parts whose keys (and type) are written with JSON escapes: the worker decodes them to the
# real keys, so each must be policed as the key it decodes to. The first ones hold no literal
# ``_url"`` anywhere; the last ones do, with the escape elsewhere.
ESCAPED_PARTS = [
    (b'{"type":"image\\u005furl","image\\u005furl":{"url":"file:///etc/passwd"}}', "image_url.url"),
    (b'{"type":"video\\u005furl","video\\u005furl":{"url":"file:///etc/passwd"}}', "video_url.url"),
    (b'{"type":"audio\\u005furl","audio\\u005furl":{"url":"file:///etc/passwd"}}', "audio_url.url"),
    (b'{"type":"image_ur\\u006c","image_ur\\u006c":"file:///etc/passwd"}', "image_url"),
    (b'{"image\\u005furl":{"url":"https://169.254.169.254/passwd"}}', "image_url.url"),
    (b'{"type":"image_url","\\u0069mage_url":"file:///etc/passwd"}', "image_url"),
    (b'{"type":"image_url","image_url":{"\\u0075rl":"file:///etc/passwd"}}', "image_url.url"),
    (b'{"type":"image_url","image_url":{"url":"file:\\u002f\\u002f/etc/passwd"}}', "image_url.url"),
]  # fmt: skip


@pytest.mark.parametrize(("part", "field"), ESCAPED_PARTS, ids=range(len(ESCAPED_PARTS)))
def test_escaped_media_part_keys_are_policed_as_the_worker_reads_them(
    stack: Stack, part: bytes, field: str
) -> None:
    error = stack.refused(CHAT, _chat_with(part), b"passwd")
    assert error["param"] == f"messages.0.content.1.{field}", error
    # In a later message, after one whose content has no media at all.
    earlier = b'{"role":"system","content":"Be brief.\\n"},'
    error = stack.refused(CHAT, _chat_with(part, before=earlier), b"passwd")
    assert error["param"] == f"messages.1.content.1.{field}", error


def test_an_escaped_key_with_an_allowed_url_is_served(stack: Stack) -> None:
    part = b'{"type":"image\\u005furl","image\\u005furl":{"url":"https://example.com/cat.png"}}'
    response = stack.post(CHAT, _chat_with(part))
    assert response.status_code == 200, response.text
    assert b"https://example.com/cat.png" in stack.worker.bodies[-1]


IN_CLUSTER = [
    "https://kubernetes.default/api/v1/secrets",
    "https://kubernetes.default.svc/api",
    "https://redis.kube-system/",
    "https://10-0-0-5.default.pod/",
    "https://grafana.monitoring.svc.cluster.local./",
    "https://metadata/computeMetadata/v1/",
    "https://[2002:a9fe:a9fe::]/latest/meta-data/",  # 6to4 of 169.254.169.254
    "https://[2002:a00:1::]/",  # 6to4 of 10.0.0.1
    "https://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "https://[::ffff:0:a9fe:a9fe]/",  # IPv4-translated
    "https://[::169.254.169.254]/",  # IPv4-compatible
    "https://[64:ff9b::a9fe:a9fe]/",  # NAT64
    "https://[64:ff9b:1::a00:1]/",  # NAT64, local use
    "https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/",  # Teredo
    "https://[fec0::1]/",  # site-local
]


def _image_part(url: str) -> bytes:
    return orjson.dumps({"type": "image_url", "image_url": {"url": url}})


@pytest.mark.parametrize("url", IN_CLUSTER)
def test_in_cluster_hosts_are_refused_on_every_surface(stack: Stack, url: str) -> None:
    secret = url.split("//")[1].split("/")[0].encode()
    error = stack.refused(CHAT, _chat_with(_image_part(url)), secret)
    assert error["param"] == "messages.0.content.1.image_url.url", error
    block = {"type": "image", "source": {"type": "url", "url": url}}
    message = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]}
    error = stack.refused(MESSAGES, message, secret)
    assert "messages.0.content.0.source.url" in error["message"], error
    image = {"type": "input_image", "image_url": url}
    response = {"model": MODEL, "input": [{"role": "user", "content": [image]}]}
    stack.refused(RESPONSES, response, secret)


def test_public_names_and_addresses_still_pass(stack: Stack) -> None:
    for url in ("https://example.default.com/a.png", "https://[2002:808:808::]/a.png"):
        response = stack.post(CHAT, _chat_with(_image_part(url)))
        assert response.status_code == 200, (url, response.text)


def test_a_client_chat_template_never_reaches_the_worker(stack: Stack) -> None:
    jinja = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"
    for kwargs in (
        {"chat_template": jinja},
        {"thinking": False, "chat_template": jinja},
        {"tokenize": True},
        {"reasoning_effort": "high"},
    ):
        key = next(k for k in kwargs if k != "thinking")
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        error = stack.refused(CHAT, body | {"chat_template_kwargs": kwargs}, b"range(99999)")
        assert error["param"] == f"chat_template_kwargs.{key}", error
        assert key in error["message"] and "limits.chat_template_kwargs" in error["message"]
    # Escaped, the key is the one the worker decodes.
    escaped = (
        b'{"model":"%s","messages":[{"role":"user","content":"hi"}],'
        b'"chat_template_kwargs":{"chat\\u005ftemplate":"{{ range(99999) }}"}}' % MODEL.encode()
    )
    error = stack.refused(CHAT, escaped, b"range(99999)")
    assert error["param"] == "chat_template_kwargs.chat_template"
    not_object = {"model": MODEL, "messages": [], "chat_template_kwargs": ["chat_template"]}
    not_object["messages"] = [{"role": "user", "content": "hi"}]
    error = stack.refused(CHAT, not_object, b"chat_template")
    assert error["param"] == "chat_template_kwargs"


def test_the_thinking_switch_still_passes(stack: Stack) -> None:
    for kwargs in ({"thinking": False}, {"enable_thinking": True}, None, {}):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        response = stack.post(CHAT, body | {"chat_template_kwargs": kwargs})
        assert response.status_code == 200, response.text
        assert stack.worker.json()["chat_template_kwargs"] == kwargs


def test_messages_and_responses_pass_no_client_template_kwargs(stack: Stack) -> None:
    """The translated surfaces build chat_template_kwargs themselves (the thinking switch
    only): a client's own is dropped, never forwarded."""
    smuggled = {"chat_template": "{{ 7 * 7 }}"}
    message = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
        "chat_template_kwargs": smuggled,
    }
    assert stack.post(MESSAGES, message).status_code == 200
    assert stack.worker.json()["chat_template_kwargs"] == {"thinking": False}
    response = {"model": MODEL, "input": "hi", "chat_template_kwargs": smuggled}
    assert stack.post(RESPONSES, response | {"reasoning": {"effort": "none"}}).status_code == 200
    assert stack.worker.json()["chat_template_kwargs"] == {"thinking": False}
    assert not any(b"7 * 7" in sent for sent in stack.worker.bodies)


def test_the_policies_are_settings(tmp_path_factory: Any) -> None:
    with (
        recording_worker() as worker,
        managed_processes(tmp_path_factory, "kwargs") as procs,
    ):
        gw = start_gateway(
            procs,
            [],
            args=("--worker-url", worker.url),
            env={
                "DFLASH_GATEWAY_LIMITS__CHAT_TEMPLATE_KWARGS": "thinking,preserve_thinking",
                "DFLASH_GATEWAY_LIMITS__IMAGE_URL_CLUSTER_SUFFIXES": "svc,cluster.local,prod",
                # Text completions take chat_template_kwargs only when allowed so: policed too.
                "DFLASH_GATEWAY_LIMITS__EXTRA_FIELDS": "chat_template_kwargs",
            },
        )
        other = Stack(gw, worker)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        kwargs = {"thinking": True, "preserve_thinking": True}
        assert other.post(CHAT, body | {"chat_template_kwargs": kwargs}).status_code == 200
        assert worker.json()["chat_template_kwargs"] == kwargs
        kwargs = {"enable_thinking": 1}
        error = other.refused(CHAT, body | {"chat_template_kwargs": kwargs}, b"enable_thinking")
        assert error["param"] == "chat_template_kwargs.enable_thinking"
        prompt = {
            "model": MODEL,
            "prompt": "hi",
            "chat_template_kwargs": {"chat_template": "J1NJ4"},
        }
        error = other.refused(COMPLETIONS, prompt, b"J1NJ4")
        assert error["param"] == "chat_template_kwargs.chat_template"
        prompt["chat_template_kwargs"] = {"preserve_thinking": False}
        assert other.post(COMPLETIONS, prompt).status_code == 200
        assert worker.json()["chat_template_kwargs"] == {"preserve_thinking": False}
        # The cluster's own namespace is refused; the default list was replaced.
        refused = other.refused(CHAT, _chat_with(_image_part("https://redis.prod/")), b"prod")
        assert refused["param"] == "messages.0.content.1.image_url.url"
        served = other.post(CHAT, _chat_with(_image_part("https://api.default/x.png")))
        assert served.status_code == 200


def _responses_variants() -> list[tuple[str, dict[str, Any]]]:
    text = {"type": "input_text", "text": "hi"}
    base: dict[str, Any] = {"model": MODEL, "input": [{"role": "user", "content": [text]}]}
    variants = []
    for bad in ([], ["input_text"], {}, {"type": "x"}):
        part = {"type": bad, "text": "hi"}
        variants += [
            ("input.0.content.0.type", base | {"input": [{"role": "user", "content": [part]}]}),
            ("tools.0.type", base | {"tools": [{"type": bad, "name": "f"}]}),
            ("reasoning.effort", base | {"reasoning": {"effort": bad}}),
            ("reasoning.summary", base | {"reasoning": {"summary": bad}}),
            ("reasoning.generate_summary", base | {"reasoning": {"generate_summary": bad}}),
        ]
    return variants


def test_responses_refuses_lists_and_objects_where_a_name_belongs(stack: Stack) -> None:
    before = len(stack.worker.bodies)
    for field, body in _responses_variants():
        for stream in (False, True):
            response = stack.post(RESPONSES, body | {"stream": stream})
            assert response.status_code == 400, (field, response.text[:300])
            assert field.split(".")[0] in error_of(response)["message"], field
    assert len(stack.worker.bodies) == before
    assert "Traceback" not in stack.gw.logs()

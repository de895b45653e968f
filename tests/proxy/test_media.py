"""Media URLs a client may have the workers fetch: ``data:`` and ``https:`` to public hosts by
default, more by ``limits.image_url_allow``; anything else is a 400 naming the field, on chat
(image, video and audio parts) and Messages (image ``url`` sources) alike, and never reaches a
worker."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.config import Settings
from app.errors import InvalidRequest
from app.media_policy import DEFAULT_POLICY, image_policy
from app.proxy.media import check_image_url
from tests.support.gateway import MODEL, FakeWorker, GatewayHarness

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"

ALLOWED = [
    "data:image/png;base64,iVBORw0KGgo=",
    "https://example.com/cat.png",
    "https://cdn.example.org:8443/a/b.jpg?x=1",
    "https://8.8.8.8/a.png",
    "https://[2606:4700:4700::1111]/a.png",
    "https://[2002:808:808::]/a.png",  # 6to4 of a public address
    "https://example.default.com/a.png",
]
REFUSED = [
    "http://example.com/cat.png",  # plaintext
    "file:///etc/passwd",
    "/var/lib/secret.png",  # a bare path: the worker reads its own disk
    "gs://bucket/a.png",
    "https://169.254.169.254/latest/meta-data/",  # cloud metadata
    "https://127.0.0.1/",
    "https://127.1/",
    "https://2130706433/",
    "https://0x7f000001/",
    "https://10.1.2.3/",
    "https://192.168.0.1/",
    "https://100.64.0.1/",
    "https://[::1]/",
    "https://[::ffff:169.254.169.254]/",
    "https://[fe80::1]/",
    "https://0.0.0.0/",
    "https://localhost/",
    "https://api.localhost/",
    "https://metadata/",  # one label: a cluster service through the search domains
    "https://metadata.google.internal/",
    "https://redis.default.svc.cluster.local/",
    "https://kubernetes.default/",  # the API server, through the cluster's search domains
    "https://kubernetes.default.svc/",
    "https://coredns.kube-system/",
    "https://10-0-0-5.default.pod/",
    "https://[2002:a9fe:a9fe::]/",  # 6to4 of 169.254.169.254
    "https://[::a9fe:a9fe]/",  # IPv4-compatible
    "https://[::ffff:0:a9fe:a9fe]/",  # IPv4-translated
    "https://[64:ff9b::a9fe:a9fe]/",  # NAT64
    "https://[64:ff9b:1::a00:1]/",  # NAT64, local use
    "https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/",  # Teredo
    "https://[fec0::1]/",  # site-local
    "https://user:pw@example.com/",
    "https://example.com\\@127.0.0.1/",
    "HTTPS://example.com/a.png",
    "",
]


@pytest.mark.parametrize("url", ALLOWED)
def test_data_and_public_https_urls_pass(url: str) -> None:
    check_image_url(url, DEFAULT_POLICY, "image_url.url")


@pytest.mark.parametrize("url", REFUSED)
def test_other_urls_are_a_400_naming_the_field(url: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_image_url(url, DEFAULT_POLICY, "messages.0.content.1.image_url.url")
    assert info.value.status == 400
    assert info.value.param == "messages.0.content.1.image_url.url"


def test_the_allow_list_adds_schemes_hosts_and_networks() -> None:
    policy = image_policy(("http:", "*.corp.example", "images.lab", "10.0.0.0/8"))
    for url in ("http://example.com/a", "https://x.corp.example/a", "http://images.lab/a"):
        check_image_url(url, policy, "f")
    check_image_url("https://10.9.9.9/a.png", policy, "f")
    for url in ("https://192.168.1.1/a", "file:///etc/passwd", "https://images.internal/a"):
        with pytest.raises(InvalidRequest):
            check_image_url(url, policy, "f")
    check_image_url("file:///models/x.png", image_policy(("*",)), "f")


def test_a_bad_allow_entry_stops_start_up() -> None:
    with pytest.raises(ValueError, match="neither a scheme"):
        Settings(limits={"image_url_allow": ("not a host/",)})
    with pytest.raises(ValueError, match="not a DNS name suffix"):
        Settings(limits={"image_url_cluster_suffixes": ("svc", "a b")})


def test_the_cluster_suffixes_are_a_setting() -> None:
    policy = image_policy((), ("*.svc", ".cluster.local", "prod"))
    for url in ("https://redis.prod/", "https://a.svc/", "https://x.cluster.local/"):
        with pytest.raises(InvalidRequest):
            check_image_url(url, policy, "f")
    check_image_url("https://kubernetes.default/", policy, "f")  # replaced, not added to
    check_image_url("https://redis.prod/", image_policy(("redis.prod",), ("prod",)), "f")


def _chat(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_chat_media_urls_are_checked_before_a_worker_sees_them() -> None:
    worker = FakeWorker()
    async with GatewayHarness([worker]) as gw:
        ssrf = await gw.post(CHAT, _chat(_image("http://169.254.169.254/latest/meta-data/")))
        local = await gw.post(CHAT, _chat({"type": "image_url", "image_url": "file:///etc/shadow"}))
        video = await gw.post(
            CHAT, _chat({"type": "video_url", "video_url": {"url": "https://10.0.0.7/v.mp4"}})
        )
        served = await gw.post(
            CHAT, _chat(_image("https://example.com/cat.png"), _image("data:image/png;base64,AA=="))
        )
    assert (ssrf.status, local.status, video.status) == (400, 400, 400)
    params = [ex.json()["error"]["param"] for ex in (ssrf, local, video)]
    assert params == [
        "messages.0.content.1.image_url.url",
        "messages.0.content.1.image_url",
        "messages.0.content.1.video_url.url",
    ]
    assert "169.254.169.254" not in orjson.dumps(worker.requests).decode()
    assert served.status == 200
    assert len(worker.requests) == 1


async def test_image_url_allow_lets_an_internal_image_host_through() -> None:
    worker = FakeWorker()
    limits = {"image_url_allow": ("http:", "images.internal")}
    async with GatewayHarness([worker], limits=limits) as gw:
        served = await gw.post(CHAT, _chat(_image("http://images.internal/cat.png")))
        refused = await gw.post(CHAT, _chat(_image("http://169.254.169.254/")))
    assert (served.status, refused.status) == (200, 400)


async def test_a_messages_image_url_source_is_checked_with_its_own_field_name() -> None:
    worker = FakeWorker()
    block = {"type": "image", "source": {"type": "url", "url": "https://[::1]:8080/x.png"}}
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, block]}],
    }
    async with GatewayHarness([worker]) as gw:
        refused = await gw.post(MESSAGES, body)
        block["source"]["url"] = "https://example.com/x.png"  # type: ignore[index]
        served = await gw.post(MESSAGES, body)
    assert refused.status == 400
    doc = refused.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.1.source.url" in doc["error"]["message"]
    assert served.status == 200
    assert worker.requests[0]["messages"][0]["content"][1]["image_url"]["url"] == (
        "https://example.com/x.png"
    )


async def test_a_responses_input_image_is_checked_too() -> None:
    worker = FakeWorker()
    image = {"type": "input_image", "image_url": "https://169.254.169.254/latest/meta-data/"}
    body = {"model": MODEL, "input": [{"role": "user", "content": [image]}]}
    async with GatewayHarness([worker]) as gw:
        refused = await gw.post("/v1/responses", body)
    assert refused.status == 400
    assert "169.254.169.254" in refused.json()["error"]["message"]
    assert worker.requests == []

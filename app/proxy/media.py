"""Which media URLs a request may send the workers: images (and a chat's video and audio parts).

An SGLang worker fetches what a request points at, from inside the GPU network: ``http(s)://``
URLs (following redirects), ``file://`` URLs and bare paths (read from its own disk), anything
else decoded as base64. Left open, that is server-side request forgery from the worker nodes: a
client could have the worker read ``http://169.254.169.254/`` (cloud credentials), internal
services or local files. By default a URL must be

- a ``data:`` URL (the image itself), or
- an ``https:`` URL whose host is a public DNS name or a public IP address: not an IP literal in
  a private, loopback, link-local, shared, multicast or reserved range (IPv4 in any of the forms
  a resolver accepts, e.g. ``2130706433`` or ``127.1``; IPv6, and every IPv6 form that embeds
  an IPv4 address: IPv4-mapped, -translated and -compatible and NAT64 ``64:ff9b::/96`` (all
  reserved), NAT64's local ``64:ff9b:1::/48``, Teredo and site-local ``fec0::/10`` always,
  6to4 ``2002::/16`` unless the IPv4 address it embeds is public); not ``localhost``, a name
  without a dot (resolved through the workers' search domains: cluster services), a name under
  ``.localhost``, ``.local``, ``.localdomain``, ``.internal``, ``.intranet``, ``.lan`` or
  ``.home.arpa``, or a name of the cluster's own (``limits.image_url_cluster_suffixes``: by
  default ``.svc``, ``.pod``, ``.cluster.local`` and the namespaces every cluster has,
  ``.default`` -- ``kubernetes.default`` -- and ``.kube-*``; Kubernetes resolves
  ``service.namespace`` to that Service, so list the cluster's namespaces there); with no
  userinfo (``user@``), no backslash, whitespace or control characters, and written in lower
  case as the worker matches it.

A DNS name is not resolved here: a public name that resolves to an internal address, or a
public URL that redirects to one, still reaches the worker. Resolving would not close that (the
worker resolves again, later); a network policy on the workers' egress does. The check is about
what a request can name, cheaply, for every request.

``limits.image_url_allow`` widens it, one entry per item (comma-separated in the environment):
``scheme:`` allows a scheme (``http:``; ``file:`` lets clients read the workers' files), and a
host pattern -- ``name``, ``*.suffix``, an IP address or a CIDR network -- allows that host
over any allowed scheme even when it is private; ``*`` allows every URL.

``check_image_url(url, policy, field)`` is the one check, raising ``InvalidRequest`` (400) naming
``field``; ``check_chat_media(messages, policy)`` applies it to a chat request's content parts.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from app.errors import InvalidRequest
from app.media_policy import HOST_NAME, SCHEME_ENTRY, ImagePolicy

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_INTERNAL_SUFFIXES = (
    ".localhost",
    ".local",
    ".localdomain",
    ".internal",
    ".intranet",
    ".lan",
    ".home.arpa",
)
# IPv6 networks whose addresses carry an IPv4 address in their last 32 bits (IPv4-compatible
# ``::/96`` is tested apart: its first 96 bits are zero), or in bits 16-48 (6to4).
_LOW_V4 = (
    ipaddress.IPv6Network("::ffff:0:0/96"),  # IPv4-mapped
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT)
    ipaddress.IPv6Network("64:ff9b::/96"),  # NAT64, well-known prefix
)
# Never public, whatever they embed: NAT64's local-use prefix (the IPv4 may sit anywhere),
# Teredo (a tunnel to an IPv4 host) and the deprecated site-local range.
_NEVER_V6 = (
    ipaddress.IPv6Network("64:ff9b:1::/48"),
    ipaddress.IPv6Network("2001::/32"),
    ipaddress.IPv6Network("fec0::/10"),
)
_BAD_CHARS = re.compile(r"[\x00-\x20\x7f\\]")
_LEGACY_IPV4 = re.compile(r"[0-9a-fx.]+")
# The content parts whose URL a worker fetches.
MEDIA_PARTS = ("image_url", "video_url", "audio_url")
# Whether a JSON span may hold a media part, decided soundly without decoding it: a part's key
# written plainly ends in ``_url"``; written any other way (``"image\\u005furl"``) it holds a
# backslash. A span with neither has no media part; any other is decoded and its decoded keys
# decide (never the raw bytes: the worker decodes escapes). The backslash is looked for first
# (in ``bytes`` a memchr; most prompts hold a ``\\n`` early), then the marker; each search
# scans the buffer without copying it (one pattern with both alternatives is 8x slower).
_MARKER = re.compile(re.escape(b'_url"'))
_ESCAPE = re.compile(re.escape(b"\\"))


def may_hold_media(span: Any) -> bool:
    """Whether the JSON text ``span`` (bytes-like) may hold a media part (see above)."""
    escaped = b"\\" in span if isinstance(span, bytes) else _ESCAPE.search(span) is not None
    return escaped or _MARKER.search(span) is not None


def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {why}", param=field)


def check_image_url(url: Any, policy: ImagePolicy, field: str) -> None:
    """Refuse (``InvalidRequest``, 400 naming ``field``) a media URL ``policy`` does not allow."""
    if not isinstance(url, str) or not url:
        raise _refuse(field, "a non-empty string URL is required")
    if policy.any_url:
        return
    scheme, colon, _ = url.partition(":")
    if not colon or not SCHEME_ENTRY.fullmatch(scheme.lower() + ":"):
        raise _refuse(field, "must be a data: URL or an https: URL")
    if scheme != scheme.lower():
        raise _refuse(field, f"the scheme must be written in lower case ({scheme.lower()}:)")
    if scheme not in policy.schemes:
        allowed = ", ".join(f"{s}:" for s in sorted(policy.schemes))
        raise _refuse(field, f"{scheme}: URLs are not accepted (allowed: {allowed})")
    if scheme == "data" or scheme == "file":
        return
    if _BAD_CHARS.search(url):
        raise _refuse(field, "the URL holds whitespace, control characters or a backslash")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 -- raises ValueError for a port out of range
    except ValueError:
        raise _refuse(field, "not a valid URL") from None
    if "@" in parts.netloc:
        raise _refuse(field, "a URL with credentials (user@host) is not accepted")
    if not host:
        raise _refuse(field, "the URL names no host")
    if not _host_allowed(host.rstrip(".") if not host.startswith("[") else host, policy):
        raise _refuse(
            field, f"the host {host!r} is not a public address (see limits.image_url_allow)"
        )


def _host_allowed(host: str, policy: ImagePolicy) -> bool:
    """Whether ``host`` (lower case, as ``urlsplit`` gives it) may be fetched."""
    address = _address(host)
    if address is not None:
        if any(address in network for network in policy.networks):
            return True
        return _public(address) and all(map(_public, _embedded(address)))
    if host in policy.names or _under(host, policy.suffixes):
        return True
    if not HOST_NAME.fullmatch(host):  # percent-encoding, unicode, stray characters
        return False
    return (
        "." in host
        and host != "localhost"
        and not host.endswith(_INTERNAL_SUFFIXES)
        and not _under(host, policy.cluster)
    )


def _under(host: str, suffixes: tuple[str, ...]) -> bool:
    """Whether ``host`` is one of ``suffixes`` (each ``.suffix``) or a name under one."""
    return any(host.endswith(suffix) or host == suffix[1:] for suffix in suffixes)


def _embedded(address: IPAddress) -> list[IPAddress]:
    """The IPv4 addresses an IPv6 ``address`` carries (a tunnel or translation reaches them);
    for one that may carry an address where it cannot be told, the unspecified address (never
    public)."""
    if address.version == 4:
        return []
    assert isinstance(address, ipaddress.IPv6Address)
    low = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if int(address) >> 32 == 0 or any(address in network for network in _LOW_V4):
        return [low]  # IPv4-compatible (::1 and :: are refused as loopback, unspecified)
    if address.sixtofour is not None:
        return [address.sixtofour]
    if any(address in network for network in _NEVER_V6):
        return [ipaddress.IPv4Address(0)]
    return []


def _public(address: IPAddress) -> bool:
    return address.is_global and not (
        address.is_multicast
        or address.is_reserved
        or address.is_unspecified
        or address.is_loopback
        or address.is_link_local
        or getattr(address, "is_site_local", False)
    )


def _address(host: str) -> IPAddress | None:
    """The IP address ``host`` is, in any form a resolver reads as one (None for a name)."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _LEGACY_IPV4.fullmatch(host):
        try:  # 127.1, 2130706433, 0x7f.0.0.1, 017700000001: what inet_aton (and curl) accept
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


class _URL(msgspec.Struct, gc=False):
    url: Any = None


class _Part(msgspec.Struct, gc=False):
    image_url: msgspec.Raw = msgspec.Raw()
    video_url: msgspec.Raw = msgspec.Raw()
    audio_url: msgspec.Raw = msgspec.Raw()


_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_PART = msgspec.json.Decoder(_Part)
_URL_OBJECT = msgspec.json.Decoder(_URL)
_ANY = msgspec.json.Decoder()


def check_chat_media(contents: Sequence[Any], policy: ImagePolicy) -> None:
    """Check the media URLs of a chat request's messages (``contents``: each message's raw
    ``content`` span): every ``image_url``/``video_url``/``audio_url`` part's ``url`` (or the
    part's value, when a string), found by the decoded keys. Only contents that may hold a part
    (``may_hold_media``) are decoded."""
    for i, content in enumerate(contents):
        view = memoryview(content)
        if not view or view[0] != ord("[") or not may_hold_media(view):
            continue
        for j, item in enumerate(_RAW_LIST.decode(view)):
            if not item or memoryview(item)[0] != ord("{") or not may_hold_media(item):
                continue
            part = _PART.decode(item)
            for name in MEDIA_PARTS:
                raw = getattr(part, name)
                if not len(raw):
                    continue
                field = f"messages.{i}.content.{j}.{name}"
                if memoryview(raw)[0] == ord("{"):
                    check_image_url(_URL_OBJECT.decode(raw).url, policy, field + ".url")
                else:
                    check_image_url(_ANY.decode(raw), policy, field)

"""``limits.image_url_allow`` and ``limits.image_url_cluster_suffixes`` as an ``ImagePolicy``:
which media URLs a request may send the workers beyond the default (``data:`` and public
``https:``), and which host names are the cluster's own. Parsed here, where the settings can check
the entries at start-up (``app.config``); applied per request by ``app.proxy.media``, whose module
doc describes the forms of an entry.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_SCHEMES = frozenset({"data", "https"})
# Names a worker in Kubernetes resolves inside the cluster (its search domains try
# ``<ns>.svc.cluster.local``, ``svc.cluster.local`` and ``cluster.local`` first, ndots:5): the
# cluster domain and its ``svc``/``pod`` zones, and the namespaces every cluster has
# (``kubernetes.default`` is the API server). ``limits.image_url_cluster_suffixes`` replaces it
# (add the cluster's own namespaces: ``redis.prod`` is the Service redis in namespace prod).
CLUSTER_SUFFIXES = (
    "svc",
    "pod",
    "cluster.local",
    "default",
    "kube-system",
    "kube-public",
    "kube-node-lease",
)
HOST_NAME = re.compile(r"[a-z0-9-]+(?:\.[a-z0-9-]+)*\.?")
SCHEME_ENTRY = re.compile(r"[a-z][a-z0-9+.-]*:")


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """The media URLs a request may send (see the module doc)."""

    schemes: frozenset[str] = DEFAULT_SCHEMES
    names: frozenset[str] = frozenset()  # hosts allowed whatever they are
    suffixes: tuple[str, ...] = ()  # ``*.suffix`` patterns, as ``.suffix``
    networks: tuple[IPNetwork, ...] = ()  # addresses allowed though private
    any_url: bool = False  # ``*``: no check at all
    # Names under these (``.suffix``, or the suffix itself) are the cluster's: refused.
    cluster: tuple[str, ...] = tuple("." + suffix for suffix in CLUSTER_SUFFIXES)


DEFAULT_POLICY = ImagePolicy()


def cluster_suffixes(entries: tuple[str, ...]) -> tuple[str, ...]:
    """``limits.image_url_cluster_suffixes`` entries (``svc``, ``.svc``, ``*.svc``) as
    ``.suffix``; a ``ValueError`` for one that is not a DNS name."""
    out = []
    for raw in entries:
        entry = raw.strip().lower().removeprefix("*").strip(".")
        if not HOST_NAME.fullmatch(entry):
            raise ValueError(f"{raw!r} is not a DNS name suffix")
        out.append("." + entry)
    return tuple(out)


@functools.cache
def image_policy(
    allow: tuple[str, ...], cluster: tuple[str, ...] = CLUSTER_SUFFIXES
) -> ImagePolicy:
    """The policy for ``limits.image_url_allow`` entries and the cluster's name suffixes
    (built once per set of entries); a ``ValueError`` for an entry that is none of the forms in
    the module doc."""
    if not allow and cluster == CLUSTER_SUFFIXES:
        return DEFAULT_POLICY
    schemes, names, suffixes, networks = set(DEFAULT_SCHEMES), set(), [], []
    any_url = False
    for raw in allow:
        entry = raw.strip().lower()
        if entry == "*":
            any_url = True
        elif SCHEME_ENTRY.fullmatch(entry):
            schemes.add(entry[:-1])
        elif entry.startswith("*."):
            suffix = entry[1:].rstrip(".")
            if not HOST_NAME.fullmatch(suffix[1:]):
                raise ValueError(f"{raw!r} is not a host pattern")
            suffixes.append(suffix)
        else:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if not HOST_NAME.fullmatch(entry):
                raise ValueError(
                    f"{raw!r} is neither a scheme (http:), a host (name, *.suffix) nor an "
                    "address or network"
                )
            names.add(entry.rstrip("."))
    return ImagePolicy(
        frozenset(schemes),
        frozenset(names),
        tuple(suffixes),
        tuple(networks),
        any_url,
        cluster_suffixes(cluster),
    )

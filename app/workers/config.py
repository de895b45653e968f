"""The workers' sections of ``app.config.Settings``: where the worker set comes from (``discovery``,
``pd``), how each worker is watched (``health``, ``kv_events``) and judged (``breaker``), how many
requests it is given (``admission``), and what it was started with (``workers``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from app.sections import CSV, Section


class HealthConfig(Section):
    """Active health checks against each worker's ``/health`` and load polling."""

    # Seconds between two ``GET /health`` checks of each worker.
    interval_s: float = Field(5.0, gt=0)
    # Deadline of one health check: longer than SGLang's ~20 s health generation, so a busy
    # worker is not marked down.
    timeout_s: float = Field(25.0, gt=0)
    # Consecutive failed checks that take a worker out of rotation.
    failure_threshold: int = Field(3, ge=1)
    # Consecutive passed checks that bring it back.
    success_threshold: int = Field(1, ge=1)
    # Seconds between two polls of each worker's ``/v1/loads`` (load, capacity, acceptance).
    loads_interval_s: float = Field(2.0, gt=0)


class BreakerConfig(Section):
    """Passive circuit breaking from request outcomes."""

    # Consecutive failed attempts on a worker (5xx, connect error, timeout) that open its breaker.
    failure_threshold: int = Field(5, ge=1)
    # Seconds an open breaker keeps requests off its worker; then one request probes it.
    open_s: float = Field(10.0, gt=0)


class AdmissionConfig(Section):
    """Per-worker concurrency cap and the bounded wait queue in front of it."""

    # None: each worker is admitted up to the max_running_requests it reports in /v1/loads (48,
    # DFLASH's default, until it has reported). A number overrides that for every worker.
    per_worker_cap: int | None = Field(None, ge=1)
    # Requests that may wait for a worker slot while every worker is at its cap; one more is
    # a 503 + Retry-After (unless the queue would serve it before its last waiter: ``tenants``).
    queue_size: int = Field(256, ge=0)
    # Longest wait in that queue; then a 503 + Retry-After.
    queue_timeout_s: float = Field(30.0, gt=0)
    # The Retry-After (seconds) of the gateway's own 503s: queue full or timed out, no healthy
    # worker, shutting down, too many connections.
    retry_after_s: int = Field(2, ge=1)


class WorkersConfig(Section):
    """What the workers were started with, where the gateway must match it."""

    # The workers run with SGLang's --enable-priority-scheduling: each request carries its
    # priority class (``tenants``) in SGLang's ``priority`` field. Off, the field is not sent
    # (SGLang ignores it then, or refuses it with --abort-on-priority-when-disabled). The chart
    # sets both together (workers.priorityScheduling).
    priority_scheduling: bool = False
    # The workers' serving engine: auto detects each worker's when it is admitted (SGLang answers
    # /server_info; vLLM answers /version and /metrics with vllm: series); sglang or vllm fixes
    # it. A worker URL written vllm+http://host:port (or sglang+http://) overrides it per worker.
    engine: Literal["auto", "sglang", "vllm"] = "auto"
    # A vLLM worker's capacity (its --max-num-seqs) when it does not report one (vLLM reports it
    # only in /server_info, served with VLLM_SERVER_DEV_MODE=1). admission.per_worker_cap
    # overrides it as it does SGLang's reported limit.
    vllm_max_num_seqs: int = Field(256, ge=1)


class KvEventsConfig(Section):
    """Subscribe to the workers' KV events (SGLang's and vLLM's --kv-events-config): what each
    worker's prefix cache stored, evicted and cleared (docs/routing.md, "KV events")."""

    # Subscribe to every worker's publisher (one ZMQ SUB socket per worker).
    enabled: bool = False
    # The port every worker publishes on (its --kv-events-config endpoint tcp://*:PORT); the
    # gateway dials the worker URL's host there.
    port: int = Field(5557, ge=1, le=65535)
    # Instead of port: the worker's HTTP port plus this (several workers on one host, e.g.
    # emulators on 30001, 30002 publishing on 31001, 31002: 1000).
    port_offset: int | None = Field(None, ge=-65534, le=65534)
    # The workers' topic (the --kv-events-config "topic"): a ZMQ subscription prefix, "" = all.
    topic: str = ""
    # Seconds between two checks of the worker set (new workers subscribed, gone ones dropped).
    resync_s: float = Field(5.0, gt=0)


class DiscoveryConfig(Section):
    """Where the worker set comes from (``static`` = ``worker_urls``)."""

    # static: ``worker_urls``; dns: the records of a headless Service (``dns_name``), re-resolved
    # every dns_interval_s; kubernetes: the workers' EndpointSlices, watched.
    mode: Literal["static", "dns", "kubernetes"] = "static"
    # dns mode: the name to resolve (a headless Service).
    dns_name: str | None = None
    # dns mode with PD disaggregation (pd.disaggregation): the prefill workers' headless Service
    # (their bootstrap port: pd.bootstrap_port).
    prefill_dns_name: str | None = None
    # dns mode with PD disaggregation: the decode workers' headless Service.
    decode_dns_name: str | None = None
    # dns mode: the workers' port.
    dns_port: int = Field(30000, ge=1, le=65535)
    # dns mode: seconds between two resolutions.
    dns_interval_s: float = Field(10.0, gt=0)
    # kubernetes mode: the namespace of the workers' EndpointSlices (of their headless Service).
    namespace: str = "default"
    # kubernetes mode: the label selector of those EndpointSlices.
    label_selector: str = "kubernetes.io/service-name=dflash-workers"
    # kubernetes mode: the name of the EndpointSlice port the workers serve HTTP on.
    port_name: str = "http"
    # kubernetes mode with PD disaggregation (pd.disaggregation): the label selector of the
    # prefill workers' EndpointSlices (their headless Service's:
    # kubernetes.io/service-name=<service>).
    prefill_label_selector: str | None = None
    # kubernetes mode with PD disaggregation: the label selector of the decode workers'
    # EndpointSlices.
    decode_label_selector: str | None = None
    # kubernetes mode with PD disaggregation: the name of the prefill EndpointSlices' port that
    # is the workers' --disaggregation-bootstrap-port (a slice without it: pd.bootstrap_port).
    bootstrap_port_name: str = "bootstrap"
    # Full re-list period: heals a watch that missed a delete (no zombie workers).
    resync_s: float = Field(30.0, gt=0)
    # In a pod these come from the service account; set api_url to run outside a cluster.
    api_url: str | None = Field(default_factory=lambda: _in_cluster_api_url())
    # The bearer token sent to the API server (read when the file exists).
    token_file: Path | None = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    # The CA bundle that verifies the API server's certificate (when the file exists).
    ca_file: Path | None = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")

    @model_validator(mode="after")
    def _check_mode(self) -> DiscoveryConfig:
        by_role = self.prefill_dns_name or self.decode_dns_name
        if self.mode == "dns" and not self.dns_name and not by_role:
            raise ValueError(
                "discovery.mode=dns needs discovery.dns_name (a headless Service name), or "
                "prefill_dns_name and decode_dns_name with PD disaggregation"
            )
        if self.mode == "kubernetes" and not self.api_url:
            raise ValueError(
                "discovery.mode=kubernetes needs the API server: run in a pod "
                "(KUBERNETES_SERVICE_HOST) or set discovery.api_url"
            )
        return self


def _in_cluster_api_url() -> str | None:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        return None
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default

PrefillPolicyName = Literal["least_queued", "prefix_affinity"]
DecodePolicyName = Literal["spare_capacity", "least_inflight"]


class PDConfig(Section):
    """Prefill/decode disaggregation (SGLang's PD protocol, as sglang-router's
    ``--pd-disaggregation``): every request goes to one prefill and one decode worker at once,
    with the bootstrap fields that pair them; the decode worker's answer is the client's."""

    # On: requests are served by prefill + decode pairs (``pd.prefill`` and ``pd.decode``, or
    # each role's DNS name or EndpointSlices: discovery.*); ``worker_urls`` must be empty. With
    # no worker source, serve starts the embedded default as one emulated prefill and one
    # emulated decode worker.
    disaggregation: bool = False
    # Prefill workers as sglang-router's ``--prefill`` takes them: ``URL`` or ``URL PORT`` (PORT:
    # the worker's ``--disaggregation-bootstrap-port``; else ``pd.bootstrap_port``).
    prefill: Annotated[list[str], NoDecode, CSV] = Field(default_factory=list)
    # Decode workers' base URLs (``--disaggregation-mode decode``).
    decode: Annotated[list[str], NoDecode, CSV] = Field(default_factory=list)
    # The bootstrap port of a prefill worker listed without one (SGLang's default).
    bootstrap_port: int = Field(DEFAULT_BOOTSTRAP_PORT, ge=1, le=65535)
    # How the prefill worker is picked: least_queued (fewest queued prefill tokens, then
    # requests) or prefix_affinity (a conversation's prefix stays on the prefill worker that has
    # it cached, bounded by prefix_affinity_load_factor).
    prefill_policy: PrefillPolicyName = "least_queued"
    # How the decode worker is picked (decode capacity bounds concurrency): spare_capacity or
    # least_inflight.
    decode_policy: DecodePolicyName = "spare_capacity"
    # Seconds a prefill worker has to finish its side of a request once the decode worker
    # answered in full; then its side is aborted and counted as the prefill worker's timeout
    # (towards opening its breaker: one that never finishes is taken out of rotation).
    prefill_drain_s: float = Field(5.0, gt=0)

    @field_validator("prefill")
    @classmethod
    def _check_prefill(cls, entries: list[str]) -> list[str]:
        cleaned = []
        for entry in entries:
            url, port = split_prefill(entry)
            _check_url(url)
            cleaned.append(url if port is None else f"{url} {port}")
        return cleaned

    @field_validator("decode")
    @classmethod
    def _check_decode(cls, urls: list[str]) -> list[str]:
        return [_check_url(url) for url in urls]

    @model_validator(mode="after")
    def _check_pools(self) -> PDConfig:
        if not self.disaggregation:
            if self.prefill or self.decode:
                raise ValueError(
                    "pd.prefill and pd.decode need pd.disaggregation (--pd-disaggregation)"
                )
            return self
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("PD disaggregation needs at least one prefill and one decode worker")
        urls = [split_prefill(p)[0] for p in self.prefill] + list(self.decode)
        if len(set(urls)) != len(urls):
            raise ValueError("prefill and decode worker URLs must be distinct")
        return self

    def prefill_workers(self) -> list[tuple[str, int]]:
        """Each prefill worker's URL and bootstrap port."""
        out = []
        for entry in self.prefill:
            url, port = split_prefill(entry)
            out.append((url, self.bootstrap_port if port is None else port))
        return out


def split_prefill(entry: str) -> tuple[str, int | None]:
    """``URL`` or ``URL PORT`` (sglang-router's ``--prefill URL [BOOTSTRAP_PORT]``)."""
    parts = entry.split()
    if len(parts) not in (1, 2):
        raise ValueError(f"prefill worker {entry!r} must be URL or URL BOOTSTRAP_PORT")
    if len(parts) == 1:
        return parts[0].rstrip("/"), None
    text = parts[1]
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"prefill worker {entry!r}: the bootstrap port must be 1..65535")
    return parts[0].rstrip("/"), int(text)


def _check_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"worker URL {url!r} must start with http:// or https://")
    return url.rstrip("/")

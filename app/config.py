"""Gateway settings: one validated object built at start-up.

Sources, highest priority first: explicit keyword arguments (the CLI flags), environment variables
(prefix ``DFLASH_GATEWAY_``, nested delimiter ``__``), a YAML or TOML file named by ``config_file``
(``--config``), then the defaults below. List values from the environment are comma-separated::

    DFLASH_GATEWAY_WORKER_URLS=http://a:30000,http://b:30000
    DFLASH_GATEWAY_HEALTH__INTERVAL_S=5
    DFLASH_GATEWAY_MODEL_ALIASES=kimi-k2.5=moonshotai/Kimi-K2.5

This is the only module that reads ``os.environ``.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.auth import check_keys, read_keys_file
from app.config_file import ConfigFileSource
from app.media_policy import CLUSTER_SUFFIXES, cluster_suffixes, image_policy
from app.model_names import check_alias
from app.routing.config import RoutingConfig
from app.tenants.config import TenantsConfig
from app.tracing.config import TracingConfig

ENV_PREFIX = "DFLASH_GATEWAY_"
DEFAULT_MODEL = "moonshotai/Kimi-K2.5"
# Added to the embedded default's aliases: the names Claude Code sends on its own.
EMBEDDED_CLAUDE_ALIAS = "claude-*"

PolicyName = Literal[
    "least_inflight",
    "power_of_two",
    "round_robin",
    "random",
    "prefix_affinity",
    "spare_capacity",
    "cache_aware",
]
POLICY_NAMES: tuple[str, ...] = typing.get_args(PolicyName)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HealthConfig(_Section):
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


class BreakerConfig(_Section):
    """Passive circuit breaking from request outcomes."""

    # Consecutive failed attempts on a worker (5xx, connect error, timeout) that open its breaker.
    failure_threshold: int = Field(5, ge=1)
    # Seconds an open breaker keeps requests off its worker; then one request probes it.
    open_s: float = Field(10.0, gt=0)


class RetryConfig(_Section):
    """Retries happen before the commit point; after it, a chat stream is continued (see
    docs/contracts.md)."""

    # Attempts per request, the first included; each retry goes to a worker not tried yet.
    max_attempts: int = Field(3, ge=1)
    # Pause before the first retry, doubled for each further one, with jitter (x 0.5-1).
    backoff_base_s: float = Field(0.05, ge=0)
    # The longest pause between two attempts.
    backoff_max_s: float = Field(1.0, ge=0)
    # No retry once this many seconds have passed since the request's first attempt.
    budget_s: float = Field(30.0, gt=0)
    # Continuations per chat stream that breaks after it began (worker killed, connection
    # reset, silent past timeouts.idle_s): the stream goes on on another worker from the text
    # relayed so far, and its client sees one stream (docs/routing.md). 0: off (an in-band
    # error ends the stream). 2 rides out a second worker lost during the first continuation.
    mid_stream_attempts: int = Field(2, ge=0, le=8)


class AdmissionConfig(_Section):
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


class TimeoutConfig(_Section):
    """Deadlines toward the workers and toward the clients."""

    # Time to open a TCP connection to a worker.
    connect_s: float = Field(5.0, gt=0)
    # Time to the worker's response headers (prefill + queueing on the worker).
    first_byte_s: float = Field(300.0, gt=0)
    # Longest silence between two upstream reads once streaming.
    idle_s: float = Field(300.0, gt=0)
    # Send ``: keep-alive`` to the client after this many silent seconds.
    keepalive_s: float = Field(15.0, gt=0)
    # No limit on total stream duration unless set.
    total_s: float | None = Field(None, gt=0)
    # Slow clients (slowloris): the request line and headers must arrive within client_header_s
    # of the connection opening (or of the previous response), the body within client_body_s of
    # the headers; else 408 and the connection is closed.
    client_header_s: float = Field(10.0, gt=0)
    # The request body must arrive within this many seconds of the headers; else 408.
    client_body_s: float = Field(60.0, gt=0)
    # A client that takes none of a response's waiting bytes for client_write_s is cut off (the
    # connection closed, what was buffered dropped): any response, refusals included. Streams
    # are judged by their relay's own slow-reader guard (idle_s) while they run.
    client_write_s: float = Field(60.0, gt=0)
    # An idle client connection is kept this long: longer than client pools and load balancers
    # keep theirs (httpx 5 s, ALB 60 s), so a reused connection is never closed under a request.
    client_keepalive_s: float = Field(75.0, gt=0)
    # An idle connection to a worker is reused for this long, then closed. Keep it under the
    # worker's own idle timeout (SGLang: uvicorn's 5 s), or a request may be sent on a connection
    # the worker is closing at that moment.
    worker_keepalive_s: float = Field(4.0, gt=0)


# Client headers ``limits.forward_headers`` cannot name: credentials, what the gateway sets itself,
# framing, encodings (a body with a Content-Encoding is refused) and hop-by-hop headers (RFC 9110
# §7.6.1).
_NEVER_FORWARDED = frozenset(
    {
        "authorization",
        "x-api-key",
        "cookie",
        "proxy-authorization",
        "host",
        "content-length",
        "content-type",
        "content-encoding",
        "transfer-encoding",
        "accept-encoding",
        "x-request-id",
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "upgrade",
        "expect",
    }
)


class LimitsConfig(_Section):
    """What one request may ask for, and the per-key request limits."""

    # Largest request body accepted; a larger one is a 413.
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    # A worker's non-streamed answer is read whole before it is relayed; a larger one is a 502.
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    # Request line + headers, counted as they arrive; more is answered 431 and the connection
    # closed.
    max_header_bytes: int = Field(64 * 1024, ge=1024)
    # Open client connections per process (with --processes N, N times this in all; the metrics
    # port has its own allowance). One more is answered 503 + Retry-After at once and closed,
    # without reading its request, so idle or slow connections cannot pin unbounded sockets and
    # memory. 4096 is far above what the workers behind one process can stream (48 per worker,
    # plus the admission queue, plus idle kept-alive connections from load balancers and client
    # pools), and well inside the usual 65536 open-file limit.
    max_connections: int = Field(4096, ge=1)
    # Pipelined requests read ahead on one client connection (the one being answered included):
    # past it the connection is not read until answers end, so one write of thousands of requests
    # costs no more than this many at a time. Clients that pipeline rarely send more than a few.
    max_pipelined: int = Field(16, ge=1, le=1024)
    # Used when a request sets neither max_tokens nor max_completion_tokens (None: no cap, and
    # SGLang then generates up to the context length). Kimi-K2.5 thinks before it answers and
    # the reasoning shares this budget: Moonshot advises at least 16,000 tokens for its
    # thinking models, so a smaller default would cut answers off (finish_reason "length").
    default_max_tokens: int | None = Field(16384, ge=1)
    # Requests asking for more are clamped to this value.
    max_tokens_cap: int = Field(32768, ge=1)
    # A longer array is refused before its messages are read (a check that grows with this).
    max_messages: int = Field(2048, ge=1, le=16384)
    # At most this many choices per request (``n``, ``best_of``) and prompts per batch
    # completions request; more is a 400.
    max_n: int = Field(8, ge=1, le=256)
    # Request fields forwarded to workers besides the built-in allow-list (app/proxy/fields.py);
    # naming a denied field here allows it (e.g. lora_path on a multi-LoRA fleet).
    # Other unknown fields are dropped. Comma-separated in the environment.
    extra_fields: Annotated[tuple[str, ...], NoDecode] = ()
    # The keys chat_template_kwargs may hold: SGLang passes them to the tokenizer's
    # apply_chat_template, where chat_template would replace the served template with the
    # client's. The default is what Kimi-K2.5's template reads (thinking, its only switch) and
    # the spelling SGLang writes beside it (enable_thinking). Another key is a 400 naming it.
    # Comma-separated in the environment.
    chat_template_kwargs: Annotated[tuple[str, ...], NoDecode] = ("thinking", "enable_thinking")
    # Client headers forwarded to workers besides traceparent, tracestate, baggage and
    # X-Emulator-Profile (app/proxy/headers.py); every other client header stays at the gateway.
    # Credentials, framing and hop-by-hop headers cannot be named. Comma-separated in the env.
    forward_headers: Annotated[tuple[str, ...], NoDecode] = ()
    # Media URLs (image_url, video_url, audio_url parts; Anthropic image url sources) allowed
    # besides data: and https: to public hosts (app/proxy/media.py): schemes ("http:", "file:"),
    # hosts ("images.corp", "*.corp.example"), addresses or networks ("10.1.0.0/16"), or "*"
    # for any URL. A URL outside them is a 400. Comma-separated in the environment.
    image_url_allow: Annotated[tuple[str, ...], NoDecode] = ()
    # Host name suffixes that are the cluster's own (its domain, svc and pod zones, namespaces):
    # a media URL naming a host under one is a 400, as a worker's resolver would find a
    # Service there (kubernetes.default, redis.prod) before any public name. Replaces the
    # default: keep it and add the cluster's namespaces. Comma-separated in the environment.
    image_url_cluster_suffixes: Annotated[tuple[str, ...], NoDecode] = CLUSTER_SUFFIXES
    # Per API key (by name): sustained requests/s with a burst, and requests in flight.
    key_rate_per_s: float | None = Field(None, gt=0)
    # Requests a key may send at once above its sustained rate (the size of its token bucket).
    key_burst: int = Field(20, ge=1)
    # Requests a key may have in flight at once (None: no limit); one more is 429 + Retry-After.
    key_max_concurrent: int | None = Field(None, ge=1)
    # Share the per-key limits across gateway replicas (redis://host:6379/0); else per process.
    redis_url: str | None = None

    @field_validator(
        "extra_fields",
        "forward_headers",
        "image_url_allow",
        "image_url_cluster_suffixes",
        "chat_template_kwargs",
        mode="before",
    )
    @classmethod
    def _fields_csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("image_url_allow")
    @classmethod
    def _check_image_urls(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        image_policy(entries)  # a ValueError names a bad entry
        return entries

    @field_validator("image_url_cluster_suffixes")
    @classmethod
    def _check_cluster_suffixes(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        cluster_suffixes(entries)  # a ValueError names a bad entry
        return entries

    @field_validator("forward_headers")
    @classmethod
    def _check_headers(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        lowered = tuple(name.strip().lower() for name in names)
        for name in lowered:
            if not name or not name.isascii() or not all(c.isalnum() or c in "-_" for c in name):
                raise ValueError(f"{name!r} is not a header name")
            if name in _NEVER_FORWARDED:
                raise ValueError(f"the {name} header is never forwarded to workers")
        return lowered

    @field_validator("extra_fields")
    @classmethod
    def _check_fields(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if "rid" in names:
            raise ValueError("rid is set by the gateway on every upstream request")
        return names


class ResponsesConfig(_Section):
    """Stored responses of ``/v1/responses`` (``app.response_store``): ``none`` keeps nothing
    (``previous_response_id`` is a 400), ``memory`` keeps them in this process, ``redis`` in the
    Redis of ``limits.redis_url`` (shared by every replica)."""

    # Where responses are kept for previous_response_id and GET/DELETE /v1/responses/{id}: none,
    # memory (this process only; refused with --processes > 1) or redis (limits.redis_url).
    store: Literal["none", "memory", "redis"] = "none"
    # Seconds a stored response stays readable after it completed.
    ttl_s: float = Field(3600.0, gt=0)
    # The in-process store's bounds (least recently used out first); a larger record is not kept.
    # When the whole store is full, the key holding the most gives way.
    max_items: int = Field(10_000, ge=1)
    # The in-process store's total size bound, in bytes of stored JSON (as max_items).
    max_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024)
    # Each API key's share of the store (memory and redis), in bytes of stored JSON: a key's
    # write past it evicts that key's own oldest responses, never another key's; a larger record
    # is not kept. Without API keys the whole gateway is one key.
    key_max_bytes: int = Field(32 * 1024 * 1024, ge=64 * 1024)
    # Each API key's share of the store in responses (memory and redis), as key_max_bytes.
    key_max_items: int = Field(1000, ge=1)


class AuthConfig(_Section):
    """Client API keys (``api_keys`` holds keys given directly) and what they protect."""

    # A file of NAME:KEY lines (e.g. a mounted Secret), re-read every reload_s (``--api-key-file``).
    # Every key at least 16 characters; a bad line stops start-up (a reload keeps the last set).
    keys_file: Path | None = None
    # Seconds between two reads of keys_file: a revoked key stops working without a restart.
    reload_s: float = Field(10.0, gt=0)
    # /metrics and /workers (worker URLs, key names) need a key. Unset (the default): they do
    # when API keys are configured, and the separate metrics port (metrics_port, for Prometheus)
    # stays open; true: a key on the metrics port too; false: open to anyone who can reach them.
    # Probes (/livez, /readyz, /health) never need one.
    protect_ops: bool | None = None

    @field_validator("keys_file")
    @classmethod
    def _check_keys_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            read_keys_file(path)  # an unreadable file is only warned about (it may appear later)
        return path


class WorkersConfig(_Section):
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


class KvEventsConfig(_Section):
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


class DiscoveryConfig(_Section):
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


class EmbeddedConfig(_Section):
    """The embedded default: emulated workers started as child processes."""

    # How many emulated workers to start.
    workers: int = Field(2, ge=1, le=16)
    # The first worker's port, the next ones following (a free port when taken, or when 0).
    base_port: int = Field(30000, ge=0, le=65535)
    # The emulated workers' ``--speed``: how many times faster than the real fleet they answer.
    speed: float = Field(1.0, gt=0)
    # The model the emulated workers serve.
    model: str = DEFAULT_MODEL


DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default

PrefillPolicyName = Literal["least_queued", "prefix_affinity"]
DecodePolicyName = Literal["spare_capacity", "least_inflight"]


class PDConfig(_Section):
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
    prefill: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Decode workers' base URLs (``--disaggregation-mode decode``).
    decode: Annotated[list[str], NoDecode] = Field(default_factory=list)
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

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _csv_list(cls, value: Any) -> Any:
        return _split_csv(value)

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


_WORKER_SCHEMES = tuple(
    f"{engine}{scheme}" for engine in ("", "vllm+", "sglang+") for scheme in ("http://", "https://")
)


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class Settings(BaseSettings):
    """Everything the gateway can be told. Validated once, at start-up."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    # A YAML (.yaml/.yml) or TOML (.toml) settings file: the lowest-priority source.
    config_file: Path | None = None
    # The address the API listens on (0.0.0.0: every interface).
    host: str = "127.0.0.1"
    # The port the API listens on.
    port: int = Field(8000, ge=0, le=65535)
    # Gateway OS processes sharing the port, each with its own event loop; /metrics adds them up.
    processes: int = Field(1, ge=1, le=64)
    # Worker base URLs (static discovery); vllm+http://host:port (or sglang+http://) names a
    # worker's engine (workers.engine). None here and discovery.mode static: the embedded
    # default (emulated workers).
    worker_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # How a request's worker is picked among those with room (docs/routing.md): cache_aware
    # weighs the prefill each worker's prefix cache saves against the load it adds.
    policy: PolicyName = "cache_aware"
    # prefix_affinity: a worker takes its keys while under this x the mean load; spare_capacity:
    # while its spare capacity is at least 1/this of the best worker's.
    prefix_affinity_load_factor: float = Field(1.25, ge=1.0)
    # Client-facing model names mapped to the served model, e.g. kimi-k2.5 -> moonshotai/Kimi-K2.5;
    # a name ending in * is a prefix pattern (claude-*: every name starting with claude-). Left
    # unset with the embedded default (make run), claude-* is added, so Claude Code answers with
    # no ANTHROPIC_MODEL set; with real workers it is only what is written here (docs/agents.md).
    model_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {"kimi-k2.5": DEFAULT_MODEL}
    )
    # NAME:KEY or KEY entries, each key at least 16 characters. Prefer DFLASH_GATEWAY_API_KEYS or
    # auth.keys_file: --api-key puts the key in the process's command line, readable by any
    # local user.
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    # Sent to workers as ``Authorization: Bearer ...`` (SGLang's --api-key); never the client's key.
    worker_api_key: SecretStr | None = None
    # After SIGTERM, /readyz answers 503 at once but new requests are still served for
    # drain_accept_s (load balancers lag behind endpoint removal); then the listener closes and
    # in-flight requests get up to drain_s to finish before the process exits.
    drain_accept_s: float = Field(5.0, ge=0)
    # In-flight requests' time to finish once the listener has closed after a SIGTERM.
    drain_s: float = Field(30.0, ge=0)
    # The level of the gateway's log.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Every log line as one JSON object (the access record's fields as top-level keys).
    log_json: bool = False
    # Browser origins allowed by CORS; empty = CORS off.
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Serve /metrics on this port instead (e.g. scraped from inside the cluster only), bound to
    # metrics_host (loopback unless set: 0.0.0.0 lets Prometheus in a cluster reach it). It has
    # the API port's header/body deadlines and size cap, and needs a key only when auth.protect_ops
    # is set to true.
    metrics_port: int | None = Field(None, ge=1, le=65535)
    # The address metrics_port listens on.
    metrics_host: str = "127.0.0.1"
    # Return each request's acceptance length to the client (header / usage field).
    expose_accept_length: bool = False

    health: HealthConfig = HealthConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    breaker: BreakerConfig = BreakerConfig()
    retry: RetryConfig = RetryConfig()
    admission: AdmissionConfig = AdmissionConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    limits: LimitsConfig = LimitsConfig()
    auth: AuthConfig = AuthConfig()
    discovery: DiscoveryConfig = DiscoveryConfig()
    embedded: EmbeddedConfig = EmbeddedConfig()
    routing: RoutingConfig = RoutingConfig()
    tenants: TenantsConfig = TenantsConfig()
    tracing: TracingConfig = TracingConfig()  # OpenTelemetry traces: app/tracing/config.py
    workers: WorkersConfig = WorkersConfig()
    responses: ResponsesConfig = ResponsesConfig()
    pd: PDConfig = PDConfig()

    @model_validator(mode="after")
    def _embedded_aliases(self) -> Settings:
        """The embedded default with ``model_aliases`` unset also answers every ``claude-*``
        name (what Claude Code sends when no ANTHROPIC_MODEL is set) with the emulated model."""
        if self.embedded_default and "model_aliases" not in self.model_fields_set:
            aliases = {**self.model_aliases, EMBEDDED_CLAUDE_ALIAS: self.embedded.model}
            # Settings is frozen; this is its own validation, before anyone reads it.
            object.__setattr__(self, "model_aliases", aliases)
        return self

    @model_validator(mode="after")
    def _check_response_store(self) -> Settings:
        if self.responses.store == "redis" and not self.limits.redis_url:
            raise ValueError("responses.store = redis needs limits.redis_url")
        if self.responses.store == "memory" and self.processes > 1:
            raise ValueError(
                "responses.store = memory keeps responses in one process: use redis with "
                "--processes > 1"
            )
        return self

    @model_validator(mode="after")
    def _check_pd(self) -> Settings:
        if self.pd.disaggregation and self.worker_urls:
            raise ValueError(
                "PD disaggregation takes its workers from pd.prefill and pd.decode: "
                "leave worker_urls empty"
            )
        discovery = self.discovery
        by_role = discovery.prefill_dns_name and discovery.decode_dns_name
        by_selector = discovery.prefill_label_selector and discovery.decode_label_selector
        if self.pd.disaggregation and discovery.mode == "kubernetes" and not by_selector:
            raise ValueError(
                "PD disaggregation with discovery.mode=kubernetes needs "
                "discovery.prefill_label_selector and discovery.decode_label_selector"
            )
        if self.pd.disaggregation and discovery.mode == "dns" and not by_role:
            raise ValueError(
                "PD disaggregation with discovery.mode=dns needs discovery.prefill_dns_name "
                "and discovery.decode_dns_name"
            )
        if (
            self.pd.disaggregation
            and discovery.mode != "static"
            and (self.pd.prefill or self.pd.decode)
        ):
            raise ValueError("pd.prefill and pd.decode are static discovery's: leave them empty")
        if not self.pd.disaggregation and (discovery.prefill_dns_name or discovery.decode_dns_name):
            raise ValueError(
                "discovery.prefill_dns_name and decode_dns_name need pd.disaggregation"
            )
        if not self.pd.disaggregation and (
            discovery.prefill_label_selector or discovery.decode_label_selector
        ):
            raise ValueError(
                "discovery.prefill_label_selector and decode_label_selector need pd.disaggregation"
            )
        if self.pd.disaggregation and any(
            name.startswith("bootstrap_") for name in self.limits.extra_fields
        ):
            raise ValueError(
                "PD disaggregation sets the bootstrap fields itself: they cannot be "
                "limits.extra_fields"
            )
        return self

    @field_validator("worker_urls", "api_keys", "cors_origins", mode="before")
    @classmethod
    def _csv_list(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        check_keys((key.get_secret_value() for key in keys), "api_keys")
        return keys

    @field_validator("worker_urls")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        cleaned = []
        for url in urls:
            if not url.startswith(_WORKER_SCHEMES):
                raise ValueError(
                    f"worker URL {url!r} must start with http:// or https:// (or name its "
                    "engine: vllm+http://, sglang+http://)"
                )
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("worker URLs must be distinct")
        return cleaned

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _alias_pairs(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        aliases: dict[str, str] = {}
        for item in _split_csv(value):
            alias, sep, target = item.partition("=")
            if not sep or not alias.strip() or not target.strip():
                raise ValueError(f"model alias {item!r} must look like alias=served-model")
            aliases[alias.strip()] = target.strip()
        return aliases

    @field_validator("model_aliases")
    @classmethod
    def _alias_names(cls, value: dict[str, str]) -> dict[str, str]:
        for alias in value:
            check_alias(alias)
        return value

    @property
    def embedded_default(self) -> bool:
        """True when no worker source is configured: serve starts emulated workers itself."""
        if self.pd.disaggregation:
            return not self.pd.prefill and self.discovery.mode == "static"
        return not self.worker_urls and self.discovery.mode == "static"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        init_kwargs = getattr(init_settings, "init_kwargs", {})
        path = init_kwargs.get("config_file") or os.environ.get(f"{ENV_PREFIX}CONFIG_FILE")
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if path:
            sources += (ConfigFileSource(settings_cls, Path(path)),)
        return sources


class ConfigError(Exception):
    """Settings could not be built; the message lists every problem, one per line."""


def load_settings(**overrides: Any) -> Settings:
    """Build Settings from overrides (CLI flags; ``None`` means "not given"), env and file."""
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**given)
    except ValueError as exc:  # pydantic.ValidationError is a ValueError
        raise ConfigError(_describe(exc)) from None


def _describe(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if errors is None:
        return f"invalid settings: {exc}"
    lines = ["invalid settings:"]
    for error in errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        env = ENV_PREFIX + "__".join(str(p).upper() for p in error["loc"] if isinstance(p, str))
        lines.append(f"  {where} (env {env}): {error['msg']}")
    return "\n".join(lines)

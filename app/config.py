"""Gateway settings: one validated object built at start-up.

Sources, highest priority first: explicit keyword arguments (the CLI flags), environment variables
(prefix ``DFLASH_GATEWAY_``, nested delimiter ``__``), a YAML or TOML file named by ``config_file``
(``--config``), then the defaults below. List values from the environment are comma-separated::

    DFLASH_GATEWAY_WORKER_URLS=http://a:30000,http://b:30000
    DFLASH_GATEWAY_HEALTH__INTERVAL_S=5
    DFLASH_GATEWAY_MODEL_ALIASES=kimi-k2.5=moonshotai/Kimi-K2.5

Each section's model lives beside the package it configures (``app/workers/config.py``,
``app/limits/config.py``, ...); this module assembles them into ``Settings`` and checks what
spans sections. The settings are the only code that reads ``os.environ``.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.auth.config import AuthConfig
from app.auth.keystore import check_keys
from app.config_file import ConfigFileSource
from app.limits.config import LimitsConfig
from app.model_names import check_alias
from app.proxy.config import RetryConfig, TimeoutConfig
from app.response_store.config import ResponsesConfig
from app.routing.config import RoutingConfig
from app.sections import CSV, split_csv
from app.server.config import DEFAULT_MODEL, EmbeddedConfig
from app.tenants.config import TenantsConfig
from app.tracing.config import TracingConfig
from app.workers.config import (
    AdmissionConfig,
    BreakerConfig,
    DiscoveryConfig,
    HealthConfig,
    KvEventsConfig,
    PDConfig,
    WorkersConfig,
)

ENV_PREFIX = "DFLASH_GATEWAY_"
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


_WORKER_SCHEMES = tuple(
    f"{engine}{scheme}" for engine in ("", "vllm+", "sglang+") for scheme in ("http://", "https://")
)


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
    worker_urls: Annotated[list[str], NoDecode, CSV] = Field(default_factory=list)
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
    api_keys: Annotated[list[SecretStr], NoDecode, CSV] = Field(default_factory=list)
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
    cors_origins: Annotated[list[str], NoDecode, CSV] = Field(default_factory=list)
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
        for item in split_csv(value):
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

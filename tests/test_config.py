from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("DFLASH_GATEWAY_"):
            monkeypatch.delenv(key)


def test_defaults_select_the_embedded_default() -> None:
    s = load_settings()
    assert (s.host, s.port, s.policy, s.processes) == ("127.0.0.1", 8000, "cache_aware", 1)
    assert s.worker_urls == []
    assert s.embedded_default
    # make run answers Claude Code's own model names (claude-opus-..., claude-sonnet-...).
    assert s.model_aliases == {"kimi-k2.5": "moonshotai/Kimi-K2.5", "claude-*": s.embedded.model}
    assert s.admission.per_worker_cap is None  # each worker's own max_running_requests


def test_env_lists_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_WORKER_URLS", "http://a:30000/, http://b:30000")
    monkeypatch.setenv(
        "DFLASH_GATEWAY_API_KEYS", "sk-one-0123456789abcdef, sk-two-0123456789abcdef"
    )
    monkeypatch.setenv("DFLASH_GATEWAY_MODEL_ALIASES", "kimi=moonshotai/Kimi-K2.5,k2=x/y")
    s = load_settings()
    assert s.worker_urls == ["http://a:30000", "http://b:30000"]
    assert [k.get_secret_value() for k in s.api_keys] == [
        "sk-one-0123456789abcdef",
        "sk-two-0123456789abcdef",
    ]
    assert s.model_aliases == {"kimi": "moonshotai/Kimi-K2.5", "k2": "x/y"}
    assert not s.embedded_default


def test_claude_pattern_is_the_embedded_defaults_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """With real workers, or aliases written out, the aliases are exactly what was written."""
    monkeypatch.setenv("DFLASH_GATEWAY_WORKER_URLS", "http://a:30000")
    assert load_settings().model_aliases == {"kimi-k2.5": "moonshotai/Kimi-K2.5"}
    monkeypatch.delenv("DFLASH_GATEWAY_WORKER_URLS")
    monkeypatch.setenv("DFLASH_GATEWAY_MODEL_ALIASES", "kimi=moonshotai/Kimi-K2.5")
    assert load_settings().model_aliases == {"kimi": "moonshotai/Kimi-K2.5"}


def test_env_nested_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_HEALTH__INTERVAL_S", "7.5")
    monkeypatch.setenv("DFLASH_GATEWAY_ADMISSION__PER_WORKER_CAP", "12")
    s = load_settings()
    assert s.health.interval_s == 7.5
    assert s.admission.per_worker_cap == 12


def test_cli_overrides_beat_env_and_none_means_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_PORT", "9000")
    monkeypatch.setenv("DFLASH_GATEWAY_POLICY", "round_robin")
    s = load_settings(port=9100, policy=None)
    assert s.port == 9100
    assert s.policy == "round_robin"


def test_yaml_config_file_with_env_on_top(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        "port: 8100\npolicy: prefix_affinity\nworker_urls: [http://w0:30000]\n"
        "health:\n  interval_s: 3\nretry:\n  max_attempts: 5\n"
    )
    monkeypatch.setenv("DFLASH_GATEWAY_RETRY__MAX_ATTEMPTS", "2")
    s = load_settings(config_file=str(cfg))
    assert s.port == 8100
    assert s.policy == "prefix_affinity"
    assert s.worker_urls == ["http://w0:30000"]
    assert s.health.interval_s == 3
    assert s.retry.max_attempts == 2


def test_toml_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text('policy = "random"\n[timeouts]\nkeepalive_s = 4\n')
    s = load_settings(config_file=str(cfg))
    assert s.policy == "random"
    assert s.timeouts.keepalive_s == 4


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"policy": "fastest"}, "policy"),
        ({"port": 70000}, "port"),
        ({"worker_urls": ["ftp://w:1"]}, "must start with http"),
        ({"worker_urls": ["http://a:1", "http://a:1/"]}, "distinct"),
        ({"model_aliases": "broken"}, "alias=served-model"),
        ({"model_aliases": "*=x/y"}, "would serve every name"),
        ({"model_aliases": "cl*ude=x/y"}, "may only end a pattern"),
    ],
)
def test_invalid_values_give_clear_messages(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings(**overrides)


def test_invalid_env_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_HEALTH__INTERVAL_S", "-1")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "DFLASH_GATEWAY_HEALTH__INTERVAL_S" in str(info.value)


def test_unknown_keys_in_file_are_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text("health:\n  intervall_s: 3\n")
    with pytest.raises(ConfigError, match="intervall_s"):
        load_settings(config_file=str(cfg))


def test_missing_or_bad_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(config_file=str(tmp_path / "nope.yaml"))
    bad = tmp_path / "gw.yaml"
    bad.write_text("port: [1\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_settings(config_file=str(bad))


def test_dns_discovery_requires_a_name() -> None:
    with pytest.raises(ConfigError, match="dns_name"):
        load_settings(discovery={"mode": "dns"})


def test_extra_fields_are_comma_separated_and_never_rid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_LIMITS__EXTRA_FIELDS", "lora_path, return_text_in_logprobs")
    assert load_settings().limits.extra_fields == ("lora_path", "return_text_in_logprobs")
    monkeypatch.setenv("DFLASH_GATEWAY_LIMITS__EXTRA_FIELDS", "rid")
    with pytest.raises(ConfigError, match="rid is set by the gateway"):
        load_settings()

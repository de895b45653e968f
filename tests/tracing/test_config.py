"""Tracing as a setting: off by default with the SDK never imported, a clear start-up error when
it is turned on without the SDK installed, and bad values refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.__main__ import main
from app.config import ConfigError, load_settings
from tests.support.procs import PYTHON

HINT = "pip install 'dflash-gateway[otel]'"
# Importing these fails, as on an install without the otel extra.
WITHOUT_SDK = ("opentelemetry.sdk", "opentelemetry.sdk.trace", "opentelemetry.exporter")


@pytest.mark.processes
def test_without_the_sdk_the_gateway_builds_and_never_imports_it() -> None:
    script = f"""
import sys
for name in {WITHOUT_SDK!r}:
    sys.modules[name] = None
from app.config import Settings
from app.main import create_app
app = create_app(Settings(worker_urls=["http://127.0.0.1:9"]))
assert app.state.gateway.tracer is None
print(sorted(m for m in sys.modules if m.startswith("opentelemetry.") and sys.modules[m]))
"""
    done = subprocess.run(
        [PYTHON, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.strip()
    assert "opentelemetry.sdk" not in loaded and "opentelemetry.exporter" not in loaded


def test_tracing_on_without_the_sdk_stops_the_start_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in WITHOUT_SDK:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setenv("DFLASH_GATEWAY_TRACING__ENABLED", "true")
    assert main(["serve", "--worker-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "tracing.enabled (env DFLASH_GATEWAY_TRACING__ENABLED)" in err
    assert HINT in err and "OpenTelemetry SDK" in err


def test_tracing_is_off_by_default() -> None:
    settings = load_settings()
    assert not settings.tracing.enabled
    assert settings.tracing.service_name == "dflash-gateway"
    assert settings.tracing.exporter == "otlp"
    assert settings.tracing.otlp_endpoint is None
    assert settings.tracing.sample_ratio == 1.0


@pytest.mark.parametrize(
    ("tracing", "problem"),
    [
        ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
        ({"exporter": "zipkin"}, "tracing.exporter"),
        ({"service_name": ""}, "tracing.service_name"),
        ({"endpoint": "http://127.0.0.1:4318"}, "tracing.endpoint"),
    ],
)
def test_bad_tracing_settings_are_refused(tracing: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_settings(tracing=tracing)

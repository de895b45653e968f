"""API keys on a real gateway: keys from the CLI, the environment and a reloaded keys file; 401s in
OpenAI shape; the key's NAME (never the key) in the access log and /metrics. (``--api-key`` given
on the command line replaces ``DFLASH_GATEWAY_API_KEYS``, as every flag replaces its variable.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from tests.e2e.conftest import poll
from tests.security.stack import CHAT, chat, emulator, error_of, start_gateway
from tests.support.procs import PYTHON, ProcessManager, free_port

CLI_KEY = "sk-cli-5f1c0e2b9a7d4c3e8b6a"
ENV_KEY = "sk-env-0d9e8c7b6a5f4e3d2c1b"
FILE_KEY = "sk-file-a1b2c3d4e5f60718293a"
KEEP_KEY = "sk-keep-77aa88bb99cc00dd11ee"


def _post(url: str, key: str | None, **extra: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(url + CHAT, json=chat(**extra), headers=headers, timeout=30)


def test_keys_from_every_source_and_revocation(procs: ProcessManager, tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# mounted Secret\nteam-file:{FILE_KEY}\nteam-keep:{KEEP_KEY}\n")
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(
        procs,
        [emu],
        args=("--api-key", f"team-cli:{CLI_KEY}"),
        env={
            "DFLASH_GATEWAY_AUTH__KEYS_FILE": str(keys_file),
            "DFLASH_GATEWAY_AUTH__RELOAD_S": "0.2",
        },
    )

    for key in (CLI_KEY, FILE_KEY):
        response = _post(gw.url, key, stream=True)
        assert response.status_code == 200, response.text
        assert response.text.endswith("data: [DONE]\n\n")
    models = httpx.get(gw.url + "/v1/models", headers={"authorization": f"Bearer {CLI_KEY}"})
    assert models.is_success

    for key in (None, "sk-wrong", CLI_KEY[:-1], CLI_KEY + "x", ENV_KEY):
        response = _post(gw.url, key)
        assert response.status_code == 401, key
        err = error_of(response)
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
        assert response.headers["x-request-id"]
    basic = httpx.post(gw.url + CHAT, json=chat(), headers={"authorization": f"Basic {CLI_KEY}"})
    assert basic.status_code == 401
    assert httpx.get(gw.url + "/v1/models").status_code == 401

    # Probes need no key; /metrics and /workers (worker URLs, key names) need one by default.
    ops = {"authorization": f"Bearer {CLI_KEY}"}
    for path in ("/livez", "/readyz", "/health"):
        assert httpx.get(gw.url + path).status_code == 200, path
    for path in ("/metrics", "/workers"):
        assert httpx.get(gw.url + path).status_code == 401, path
        assert httpx.get(gw.url + path, headers=ops).status_code == 200, path

    # Revoking a key in the file: it stops working without a restart; the others keep working.
    keys_file.write_text(f"team-keep:{KEEP_KEY}\n")
    os.utime(keys_file, ns=(1, 1))
    poll(lambda: _post(gw.url, FILE_KEY).status_code == 401, timeout=10)
    assert _post(gw.url, KEEP_KEY).status_code == 200
    assert _post(gw.url, CLI_KEY).status_code == 200

    metrics = httpx.get(gw.url + "/metrics", headers=ops).text
    assert 'dflash_gateway_key_requests_total{key="team-cli"} 2.0' in metrics
    assert 'dflash_gateway_key_requests_total{key="team-keep"} 1.0' in metrics
    tokens = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith('dflash_gateway_key_completion_tokens_total{key="team-file"}')
    ]
    assert tokens and tokens[0] > 0

    logs = gw.logs()
    assert "--api-key puts keys on the command line, readable in /proc" in logs
    assert logs.count("readable in /proc") == 1
    assert "key=team-cli" in logs
    assert "key=team-file" in logs
    for secret in (CLI_KEY, ENV_KEY, FILE_KEY, KEEP_KEY, "sk-wrong"):
        assert secret not in logs
        assert secret not in metrics
    workers = httpx.get(gw.url + "/workers", headers=ops).text
    assert all(secret not in workers for secret in (CLI_KEY, ENV_KEY, FILE_KEY, KEEP_KEY))


def test_with_keys_metrics_and_workers_need_one_by_default(procs: ProcessManager) -> None:
    """/workers shows the workers' URLs and /metrics the key names: with keys configured they
    need a key unless auth.protect_ops is false. The metrics port stays Prometheus's: open."""
    emu = emulator(procs, "emu", "--speed", "50")
    metrics_port = free_port()
    gw = start_gateway(
        procs,
        [emu],
        env={
            "DFLASH_GATEWAY_API_KEYS": f"ops:{ENV_KEY}, team-b:{KEEP_KEY}",
            "DFLASH_GATEWAY_METRICS_PORT": str(metrics_port),
        },
    )
    assert _post(gw.url, KEEP_KEY).status_code == 200
    assert _post(gw.url, CLI_KEY).status_code == 401
    auth = {"authorization": f"Bearer {ENV_KEY}"}
    response = httpx.get(gw.url + "/workers")
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"
    assert emu.url not in response.text
    workers = httpx.get(gw.url + "/workers", headers=auth)
    assert workers.status_code == 200 and emu.url in workers.text
    for path in ("/livez", "/readyz", "/health"):  # probes carry no credentials
        assert httpx.get(gw.url + path).status_code == 200
    # /metrics is on the metrics port (404 on the API port, whatever the key), open to scrapers.
    assert httpx.get(gw.url + "/metrics", headers=auth).status_code == 404
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'dflash_gateway_key_requests_total{key="team-b"} 1.0' in metrics
    assert 'dflash_gateway_key_requests_total{key="ops"} 0.0' in metrics  # pre-initialised
    assert ENV_KEY not in metrics and KEEP_KEY not in metrics
    assert ENV_KEY not in gw.logs() and KEEP_KEY not in gw.logs()


def test_protect_ops_false_opens_metrics_and_workers(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(
        procs,
        [emu],
        env={
            "DFLASH_GATEWAY_API_KEYS": f"ops:{ENV_KEY}",
            "DFLASH_GATEWAY_AUTH__PROTECT_OPS": "false",
        },
    )
    assert _post(gw.url, None).status_code == 401  # the API itself still needs a key
    for path in ("/metrics", "/workers"):
        assert httpx.get(gw.url + path).status_code == 200, path


def test_no_keys_is_open_with_a_warning(procs: ProcessManager) -> None:
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(procs, [emu])
    assert _post(gw.url, None).status_code == 200
    assert _post(gw.url, "anything").status_code == 200
    assert "no API keys configured" in gw.logs()


def test_blanking_a_key_revokes_it_and_never_makes_a_key(
    procs: ProcessManager, tmp_path: Path
) -> None:
    """``team-b:`` (a key blanked by hand) is a bad line, not the key "team-b:": the reload is
    refused and logged (file and line, never a key) and the previous keys stay in force."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"team-keep:{KEEP_KEY}\nteam-b:{FILE_KEY}\n")
    emu = emulator(procs, "emu", "--speed", "50")
    gw = start_gateway(
        procs,
        [emu],
        args=("--api-key-file", str(keys_file)),
        env={"DFLASH_GATEWAY_AUTH__RELOAD_S": "0.2"},
    )
    assert _post(gw.url, FILE_KEY).status_code == 200
    assert "readable in /proc" not in gw.logs()

    keys_file.write_text(f"team-keep:{KEEP_KEY}\nteam-b:\n")
    os.utime(keys_file, ns=(1, 1))
    poll(lambda: "API keys file not reloaded" in gw.logs(), timeout=10)
    assert f"{keys_file} line 2: the key of 'team-b' is empty" in gw.logs()
    assert _post(gw.url, "team-b:").status_code == 401
    assert _post(gw.url, FILE_KEY).status_code == 200  # the previous set is kept

    keys_file.write_text(f"team-keep:{KEEP_KEY}\n")  # the way to revoke: delete the line
    os.utime(keys_file, ns=(2, 2))
    poll(lambda: _post(gw.url, FILE_KEY).status_code == 401, timeout=10)
    assert _post(gw.url, KEEP_KEY).status_code == 200
    assert FILE_KEY not in gw.logs() and KEEP_KEY not in gw.logs()


def _serve_exit(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    argv = [PYTHON, "-m", "app", "serve", "--port", "0", "--worker-url", "http://127.0.0.1:9"]
    done = subprocess.run(
        [*argv, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        cwd=os.getcwd(),
    )
    return done.returncode, done.stderr


def test_empty_or_short_keys_refuse_to_start(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# keys\nteam-a:{KEEP_KEY}\nteam-b:\n")
    code, err = _serve_exit(tmp_path, "--api-key-file", str(keys_file))
    assert code == 2, err
    assert f"{keys_file} line 3: the key of 'team-b' is empty" in err
    assert KEEP_KEY not in err and "Traceback" not in err

    code, err = _serve_exit(tmp_path, "--api-key", "team-a:sk-short1")
    assert code == 2, err
    assert "key shorter than 16 characters" in err and "sk-short1" not in err

    code, err = _serve_exit(tmp_path, env={"DFLASH_GATEWAY_API_KEYS": f"a:{ENV_KEY},team-b:"})
    assert code == 2, err
    assert "DFLASH_GATEWAY_API_KEYS" in err and "entry 2" in err and ENV_KEY not in err

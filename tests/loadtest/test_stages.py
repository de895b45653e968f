"""``python -m loadtest.stages``: a py-spy raw profile split by request stage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILE = "\n".join(
    [
        # the innermost frame of a stage wins over the frames around it
        "Runner.run (asyncio/runners.py:118);serve_entry (app/proxy/ingress.py:150);"
        "Proxy.run (app/proxy/forward.py:180);Proxy._record (app/proxy/forward.py:239);"
        "Counter.inc (prometheus_client/metrics.py:342) 3",
        "Runner.run (asyncio/runners.py:118);serve_entry (app/proxy/ingress.py:150);"
        "parse_request (app/proxy/request.py:124) 2",
        "Runner.run (asyncio/runners.py:118);serve_entry (app/proxy/ingress.py:150) 1",
        "Runner.run (asyncio/runners.py:118);HttpConnection.data_received "
        "(app/server/uvicorn/protocol.py:187) 2",
        "Runner.run (asyncio/runners.py:118) 2",
    ]
)


def test_samples_are_charged_to_the_innermost_stage_and_given_per_request(tmp_path: Path) -> None:
    raw = tmp_path / "gw.raw"
    raw.write_text(PROFILE + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.stages", str(raw), "--units", "10", "--cpu-s", "0.01"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows = {line.rsplit("  ", 1)[1]: line.split()[0] for line in done.stdout.splitlines()}
    assert rows == {
        "metrics (prometheus_client, the request's series)": "30.0%",
        "request checks: headers, key, tenant, body, validation, upstream body": "20.0%",
        "HTTP server: uvicorn's protocol and ASGI cycle, the connection guard": "20.0%",
        "event loop and kernel I/O outside a request frame": "20.0%",
        "request coroutines' own lines (serve_entry, Proxy.run...)": "10.0%",
    }
    assert " 300.0 µs  metrics" in done.stdout  # 30% of 10 ms over 10 requests


def test_a_profile_with_no_stage_in_it_is_an_error_not_an_empty_table(tmp_path: Path) -> None:
    raw = tmp_path / "gw.raw"
    raw.write_text("run (asyncio/runners.py:118);inc (prometheus_client/metrics.py:342) 5\n")
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.stages", str(raw)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "no sample matched a stage" in done.stderr

"""The metrics against ground truth and a real Prometheus.

Two emulated workers, a gateway (``expose_accept_length`` on, one API key) and a real Prometheus
scraping all three every second with the chart's rules. Traffic: per profile, 200 streamed and
200 non-streamed chat requests (a mix of thinking on with a random ``max_tokens`` and thinking
off). Then:

- exact (non-streamed) acceptance length = the emulator's per-request value;
- estimated (streamed) per-request acceptance length: its unweighted per-request mean (the seed
  card's estimator) within 5 % of the ground truth's, per profile;
- the fleet figure ``completion_tokens / spec_verify_steps`` from Prometheus within 2 % of the
  token-weighted truth, per profile and as ``rate()/rate()`` over the whole run;
- ``completion_tokens_total`` = the sum of ``usage.completion_tokens`` the clients saw;
- every Grafana panel query (variables substituted) and every recording rule returns data, and
  every metric a panel names exists; ``promtool check metrics`` on ``/metrics`` is clean.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from tests.support.procs import PYTHON, ManagedProcess, free_port, managed_processes
from tests.support.prometheus import Prometheus, start_prometheus
from tests.support.tools import require_tool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "k8s" / "dflash-gateway" / "files" / "dflash-gateway.json"
RULES = ROOT / "deploy" / "k8s" / "dflash-gateway" / "files" / "rules.yaml"
PROFILES = ("gsm8k", "math500", "humaneval", "mbpp", "mtbench")
PER_PROFILE = 200  # of each kind: streamed (estimated) and non-streamed (exact)
KEY = "team-a"
SECRET = "metrics-test-secret"
COMPLETIONS = 20
EMULATE = [PYTHON, "-m", "app", "emulate", "--port", "{port}", "--speed", "50"]
VARIABLES = {"$model": ".*", "$worker": ".*", "$key": ".*", "$__rate_interval": "1m"}
METRIC_NAME = re.compile(r"\b(dflash_gateway_[a-z_]+|sglang:[a-z_]+)\b")


@dataclass
class Result:
    profile: str
    stream: bool
    rid: str
    completion_tokens: int
    accept_length: float  # what the client got (header / usage field)


@dataclass
class Phase:
    profile: str
    results: list[Result]
    completion: float  # Prometheus: sum(completion_tokens_total) after the phase
    steps: float  # Prometheus: sum(spec_verify_steps_total) after the phase


@dataclass
class Live:
    gw: ManagedProcess
    emus: list[ManagedProcess]
    prom: Prometheus
    phases: list[Phase] = field(default_factory=list)
    truth: dict[str, dict[str, Any]] = field(default_factory=dict)  # rid -> emulator record
    client_completion_tokens: int = 0
    started: float = 0.0
    metrics_url: str = ""  # the gateway's metrics port (Prometheus's; the API port's needs a key)

    def results(self, profile: str, stream: bool) -> list[Result]:
        phase = next(p for p in self.phases if p.profile == profile)
        return [r for r in phase.results if r.stream is stream]


def _body(rng: random.Random, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "kimi-k2.5",
        "messages": [{"role": "user", "content": f"Question {rng.getrandbits(64)}"}],
    }
    if rng.random() < 0.5:
        body["chat_template_kwargs"] = {"thinking": False}
    else:  # thinking on: some of these cross from reasoning to content within max_tokens
        body["max_tokens"] = rng.randint(100, 900)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _one(client: httpx.AsyncClient, url: str, profile: str, body: dict[str, Any]) -> Result:
    headers = {"X-Emulator-Profile": profile, "Authorization": f"Bearer {SECRET}"}
    response = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    if body.get("stream"):
        events = [e[6:] for e in response.content.split(b"\n\n") if e.startswith(b"data: {")]
        usage = orjson.loads(events[-1])["usage"]
        rid = orjson.loads(events[0])["id"]
        length = usage["spec_accept_length"]
    else:
        doc = response.json()
        assert all("meta_info" not in c for c in doc["choices"])  # the gateway's own request
        usage, rid = doc["usage"], doc["id"]
        length = float(response.headers["x-dflash-accept-length"])
    return Result(profile, bool(body.get("stream")), rid, usage["completion_tokens"], length)


async def _drive(url: str, profile: str, rng: random.Random) -> list[Result]:
    bodies = [_body(rng, stream) for stream in (True, False) for _ in range(PER_PROFILE)]
    rng.shuffle(bodies)
    gate = asyncio.Semaphore(32)
    limits = httpx.Limits(max_connections=32)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def run(body: dict[str, Any]) -> Result:
            async with gate:
                return await _one(client, url, profile, body)

        return await asyncio.gather(*(run(b) for b in bodies))


async def _other_traffic(url: str) -> int:
    """Text completions (streamed and not) and a refused model: the other routes and statuses."""
    headers = {"Authorization": f"Bearer {SECRET}"}
    tokens = 0
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(COMPLETIONS):
            body: dict[str, Any] = {"model": "kimi-k2.5", "prompt": f"Say {i}", "max_tokens": 40}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
            response = await client.post(url + "/v1/completions", json=body, headers=headers)
            assert response.status_code == 200
            if i % 2:
                last = [e for e in response.content.split(b"\n\n") if b'"usage":{' in e][-1]
                tokens += orjson.loads(last[6:])["usage"]["completion_tokens"]
            else:
                tokens += response.json()["usage"]["completion_tokens"]
        missing = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
        response = await client.post(url + "/v1/chat/completions", json=missing, headers=headers)
        assert response.status_code == 404
    return tokens


def _scalar(prom: Prometheus, expr: str) -> float:
    result = prom.query(expr)
    assert result, f"{expr} returned no data"
    return float(result[0]["value"][1])


def _settle(live: Live, target: int, timeout: float = 30.0) -> tuple[float, float]:
    """Wait until Prometheus has scraped every completion token the clients saw; then the
    fleet's (completion tokens, verify steps) as Prometheus has them."""
    deadline = time.monotonic() + timeout
    while True:
        completion = _scalar(live.prom, "sum(dflash_gateway_completion_tokens_total)")
        if completion >= target or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return completion, _scalar(live.prom, "sum(dflash_gateway_spec_verify_steps_total)")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    require_tool("prometheus")  # before anything starts
    with managed_processes(tmp_path_factory, "metrics") as manager:
        emus = [
            manager.start(
                [*EMULATE, "--seed", str(i)],
                name=f"emu-{i}",
                ready_status=200,
            )
            for i in range(2)
        ]
        argv = [PYTHON, "-m", "app", "serve", "--port", "{port}", "--api-key", f"{KEY}:{SECRET}"]
        for emu in emus:
            argv += ["--worker-url", emu.url]
        metrics_port = free_port()
        gw = manager.start(
            argv,
            name="gateway",
            ready_path="/readyz",
            ready_status=200,
            env={
                # As deployed: Prometheus scrapes the metrics port, open to it while the API
                # port's /metrics needs a client key (keys are configured).
                "DFLASH_GATEWAY_METRICS_PORT": str(metrics_port),
                "DFLASH_GATEWAY_HEALTH__INTERVAL_S": "0.3",
                "DFLASH_GATEWAY_HEALTH__LOADS_INTERVAL_S": "0.5",
                "DFLASH_GATEWAY_EXPOSE_ACCEPT_LENGTH": "true",
                "DFLASH_GATEWAY_LOG_LEVEL": "warning",
            },
        )
        targets: dict[str, Sequence[str]] = {
            "dflash-gateway": [f"127.0.0.1:{metrics_port}"],
            "sglang-workers": [f"127.0.0.1:{e.port}" for e in emus],
        }
        prom = start_prometheus(manager, targets, rule_files=[str(RULES)])
        # Every series starts from a scraped zero, so rate() sees the whole increase.
        for job, hosts in targets.items():  # all of a job's targets, not the first one up
            assert prom.wait_for(f'count(up{{job="{job}"}} == 1) == {len(hosts)}'), job
        assert prom.wait_for("dflash_gateway_completion_tokens_total")
        live = Live(
            gw, emus, prom, started=time.time(), metrics_url=f"http://127.0.0.1:{metrics_port}"
        )
        rng = random.Random(20261202)
        seen = 0
        for profile in PROFILES:
            results = asyncio.run(_drive(gw.url, profile, rng))
            seen += sum(r.completion_tokens for r in results)
            completion, steps = _settle(live, seen)
            live.phases.append(Phase(profile, results, completion, steps))
        seen += asyncio.run(_other_traffic(gw.url))
        live.client_completion_tokens = seen
        for emu in emus:
            stats = httpx.get(emu.url + "/emulator/stats", timeout=10).json()
            live.truth.update({r["rid"]: r for r in stats["requests"]})
        _settle(live, seen)
        yield live


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_exact_acceptance_length_is_the_workers_per_request_value(live: Live) -> None:
    for profile in PROFILES:
        results = live.results(profile, stream=False)
        assert len(results) >= 200
        for r in results:
            truth = live.truth[r.rid]
            assert not truth["stream"] and truth["profile"] == profile
            assert r.accept_length == pytest.approx(truth["spec_accept_length"], abs=5e-5)
    # The histogram holds the unrounded values: its sum is the truth's sum.
    exact = [
        live.truth[r.rid]["spec_accept_length"]
        for p in PROFILES
        for r in live.results(p, stream=False)
    ]
    total = _scalar(live.prom, 'sum(dflash_gateway_spec_accept_length_sum{source="exact"})')
    count = _scalar(live.prom, 'sum(dflash_gateway_spec_accept_length_count{source="exact"})')
    assert count == len(exact)
    assert total == pytest.approx(sum(exact), rel=1e-9)


def test_estimated_per_request_mean_within_5_percent_per_profile(live: Live) -> None:
    """The unweighted mean over requests (the seed card's estimator) of the streams' estimates
    against the mean of the emulator's per-request values."""
    lines = []
    for profile in PROFILES:
        results = live.results(profile, stream=True)
        assert len(results) >= 200
        for r in results:
            assert live.truth[r.rid]["stream"] and live.truth[r.rid]["profile"] == profile
        estimated = _mean([r.accept_length for r in results])
        truth = _mean([live.truth[r.rid]["spec_accept_length"] for r in results])
        exact = _mean([r.accept_length for r in live.results(profile, stream=False)])
        lines.append(
            f"{profile}: estimated mean {estimated:.4f} vs truth {truth:.4f} "
            f"({(estimated / truth - 1) * 100:+.2f} %); exact mean {exact:.4f}"
        )
        assert estimated == pytest.approx(truth, rel=0.05), lines[-1]
    print("\n".join(lines))
    # Prometheus' per-request mean of the estimates is the clients' mean.
    estimates = [r.accept_length for p in PROFILES for r in live.results(p, stream=True)]
    total = _scalar(live.prom, 'sum(dflash_gateway_spec_accept_length_sum{source="estimated"})')
    count = _scalar(live.prom, 'sum(dflash_gateway_spec_accept_length_count{source="estimated"})')
    assert count == len(estimates) + COMPLETIONS // 2
    assert total / count == pytest.approx(_mean(estimates), rel=0.02)


def test_fleet_ratio_within_2_percent_of_the_token_weighted_truth(live: Live) -> None:
    lines = []
    completion, steps = 0.0, 0.0
    for phase in live.phases:
        records = [live.truth[r.rid] for r in phase.results]
        truth = sum(r["completion_tokens"] for r in records) / sum(r["steps"] for r in records)
        ratio = (phase.completion - completion) / (phase.steps - steps)
        completion, steps = phase.completion, phase.steps
        lines.append(f"{phase.profile}: fleet {ratio:.4f} vs token-weighted truth {truth:.4f}")
        assert ratio == pytest.approx(truth, rel=0.02), lines[-1]
    # The PromQL of the dashboard and the rules, over the whole run, against both workers' totals.
    window = f"{int(time.time() - live.started) + 60}s"
    fleet = _scalar(
        live.prom,
        f"sum(rate(dflash_gateway_completion_tokens_total[{window}])) / "
        f"sum(rate(dflash_gateway_spec_verify_steps_total[{window}]))",
    )
    totals = [httpx.get(e.url + "/emulator/stats", timeout=10).json()["totals"] for e in live.emus]
    truth = sum(t["completion_tokens"] for t in totals) / sum(t["verify_steps"] for t in totals)
    lines.append(f"whole run: rate()/rate() {fleet:.4f} vs token-weighted truth {truth:.4f}")
    print("\n".join(lines))
    assert fleet == pytest.approx(truth, rel=0.02), lines[-1]


def test_completion_tokens_total_is_what_the_clients_saw(live: Live) -> None:
    metrics = httpx.get(live.metrics_url + "/metrics", timeout=10).text
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("dflash_gateway_completion_tokens_total{")
    )
    assert total == live.client_completion_tokens
    key = _scalar(live.prom, f'dflash_gateway_key_completion_tokens_total{{key="{KEY}"}}')
    assert key == live.client_completion_tokens


def _exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) and node["expr"] else []
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def _substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def missing_data(prom: Prometheus, exprs: list[str]) -> list[str]:
    """The expressions that name a metric Prometheus does not have, or return no series."""
    names = set(httpx.get(prom.url + "/api/v1/label/__name__/values", timeout=10).json()["data"])
    missing = []
    for expr in exprs:
        unknown = set(METRIC_NAME.findall(expr)) - names
        if unknown:
            missing.append(f"{expr}: no such metric {sorted(unknown)}")
        elif not prom.query(_substitute(expr)):
            missing.append(f"{expr}: no data")
    return missing


# The PD row has data only in front of prefill and decode workers: tests/e2e/test_pd.py checks it.
PD_ROW = "Prefill/decode disaggregation"


def test_every_dashboard_query_returns_data(live: Live) -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = _exprs(board["panels"])
    pd = set(_exprs(_row(board, PD_ROW)))
    assert pd
    exprs = [e for e in exprs if e not in pd]
    assert len(exprs) > 30
    assert missing_data(live.prom, exprs) == []
    for variable in board["templating"]["list"]:
        query = variable.get("definition")
        if not query:
            continue
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", query).groups()  # type: ignore[union-attr]
        values = httpx.get(
            live.prom.url + f"/api/v1/label/{label}/values",
            params={"match[]": metric},
            timeout=10,
        ).json()["data"]
        assert values, query


def _row(board: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels under the row named ``title``."""
    out: list[dict[str, Any]] = []
    inside = False
    for panel in board["panels"]:
        if panel["type"] == "row":
            inside = panel["title"] == title
        elif inside:
            out.append(panel)
    return out


def test_tenant_panels_show_the_configured_key_and_every_priority_class(live: Live) -> None:
    panels = {p["title"]: p for p in _row(json.loads(DASHBOARD.read_text()), "Tenants")}
    assert len(panels) == 7
    for title in ("Completion", "Prompt", "Reasoning"):
        [t] = panels[f"{title} tokens/s per key"]["targets"]
        keys = {r["metric"].get("key") for r in live.prom.query(_substitute(t["expr"]))}
        assert keys == {KEY}, title
    [t] = panels["Quota rejections/s"]["targets"]
    series = {
        (r["metric"]["key"], r["metric"]["quota"]) for r in live.prom.query(_substitute(t["expr"]))
    }
    assert series == {(KEY, "tokens_per_min"), (KEY, "tokens_per_day")}
    for t in panels["Queue wait by priority class"]["targets"]:
        classes = {r["metric"]["priority"] for r in live.prom.query(_substitute(t["expr"]))}
        assert classes == {"low", "normal", "high"}
    [t] = panels["Usage log lines dropped/s"]["targets"]
    [dropped] = live.prom.query(_substitute(t["expr"]))
    assert float(dropped["value"][1]) == 0
    [t] = panels["Limit store errors/s"]["targets"]
    errors = {r["metric"]["limit"]: r["value"][1] for r in live.prom.query(_substitute(t["expr"]))}
    # pre-initialised, no Redis: no errors
    assert errors == {"requests": "0", "tokens": "0", "session_homes": "0"}


def test_a_dashboard_naming_a_missing_metric_fails(live: Live) -> None:
    wrong = [
        "sum(rate(dflash_gateway_no_such_metric_total[$__rate_interval]))",
        'sum(dflash_gateway_requests_total{model="no-such-model-label"})',
    ]
    assert len(missing_data(live.prom, wrong)) == 2


def test_every_recording_rule_returns_data(live: Live) -> None:
    rules = yaml.safe_load(RULES.read_text())
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert len(records) >= 10
    empty = [name for name in records if not live.prom.wait_for(name, timeout=10)]
    assert empty == []
    # The alert expressions evaluate too (no alert is expected to fire on healthy traffic).
    firing = [a for a in live.prom.query("ALERTS") if a["metric"].get("alertstate") == "firing"]
    assert firing == []


def test_promtool_check_metrics_is_clean(promtool: str, live: Live) -> None:
    metrics = httpx.get(live.metrics_url + "/metrics", timeout=10).text
    done = subprocess.run(
        [promtool, "check", "metrics"], input=metrics, capture_output=True, text=True
    )
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        done.stdout + done.stderr
    )

"""Builds the Grafana dashboard from the metric names in docs/contracts.md.

    python deploy/tools/dashboard.py          # rewrite the chart's file and its copy
    python deploy/tools/dashboard.py --check  # exit 1 if either file differs (tests run this)

The chart's ``files/dflash-gateway.json`` is canonical (Helm can only read files inside the chart);
``deploy/grafana/dflash-gateway.json`` is an identical copy for Grafana provisioning outside it.
Every query here is checked against a real Prometheus scraping a real gateway in the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CANONICAL = ROOT / "deploy" / "k8s" / "dflash-gateway" / "files" / "dflash-gateway.json"
COPY = ROOT / "deploy" / "grafana" / "dflash-gateway.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model=~"$model"'
W = 'worker=~"$worker"'
K = 'key=~"$key"'
P = "dflash_gateway_"
R = "[$__rate_interval]"
# The seed model card's acceptance lengths (thinking on, block 8): the baseline lines.
SEED_TAU = {"GSM8K": 5.3, "Math500": 5.5, "HumanEval": 5.3, "MBPP": 4.5, "MT-Bench": 3.7}


class Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_h = 0

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "id": len(self.panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
            self.x, self.row_h = 0, 0

    def add(self, panel: dict[str, Any], w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = len(self.panels) + 1
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


def target(expr: str, legend: str, ref: str = "A") -> dict[str, Any]:
    return {"refId": ref, "datasource": DS, "expr": expr, "legendFormat": legend}


def timeseries(
    title: str,
    unit: str,
    targets: list[dict[str, Any]],
    description: str = "",
    thresholds: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    defaults: dict[str, Any] = {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}}
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "bottom",
                "calcs": ["lastNotNull", "mean"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
    }


def stat(
    title: str, unit: str, expr: str, description: str = "", decimals: int | None = None
) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
        },
        "targets": [target(expr, title)],
    }


def quantiles(metric: str, by: str = "", match: str = M) -> list[dict[str, Any]]:
    group = f"le{', ' + by if by else ''}"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        target(
            f"histogram_quantile({q}, sum by ({group}) "
            f"(rate({P}{metric}_bucket{{{match}}}[$__rate_interval])))",
            f"p{int(q * 100)}{suffix}",
        )
        for q in (0.5, 0.99)
    ]


def panels() -> list[dict[str, Any]]:
    g = Layout()
    g.row("DFlash acceptance")
    g.add(
        stat(
            "Acceptance length (fleet, token-weighted)",
            "none",
            f"sum(rate({P}completion_tokens_total{{{M}}}[5m])) / "
            f"sum(rate({P}spec_verify_steps_total{{{M}}}[5m]))",
            "Completion tokens per verify step over all requests (token-weighted). The seed card's "
            "per-dataset figures are unweighted means of per-request values: 3.7 (MT-Bench) to 5.5 "
            "(Math500).",
            decimals=2,
        ),
        w=6,
        h=6,
    )
    g.add(
        stat(
            "Acceptance length (mean per request)",
            "none",
            f"sum(rate({P}spec_accept_length_sum{{{M}}}[5m])) / "
            f"sum(rate({P}spec_accept_length_count{{{M}}}[5m]))",
            "Unweighted mean of per-request acceptance lengths (the seed harness's estimator); "
            "exact for non-streaming requests, estimated from chunks for streams.",
            decimals=2,
        ),
        w=6,
        h=6,
    )
    g.add(
        stat(
            "Output tokens/s (fleet)",
            "short",
            f"sum(rate({P}completion_tokens_total{{{M}}}[1m]))",
            "Completion tokens per second through the gateway (rate of the counter).",
        ),
        w=6,
        h=6,
    )
    g.add(
        stat(
            "Healthy workers",
            "none",
            f"sum({P}worker_up)",
            "Workers passing health checks with a closed breaker.",
        ),
        w=6,
        h=6,
    )
    baseline = [target(f"vector({tau})", f"seed {name} ({tau})") for name, tau in SEED_TAU.items()]
    g.add(
        timeseries(
            "Acceptance length vs the seed card",
            "none",
            [
                target(
                    f"sum by (model) (rate({P}completion_tokens_total{{{M}}}[$__rate_interval])) / "
                    f"sum by (model) (rate({P}spec_verify_steps_total{{{M}}}[$__rate_interval]))",
                    "fleet token-weighted {{model}}",
                ),
                target(
                    f"sum by (source) (rate({P}spec_accept_length_sum{{{M}}}[$__rate_interval])) / "
                    f"sum by (source) (rate({P}spec_accept_length_count{{{M}}}[$__rate_interval]))",
                    "per-request mean ({{source}})",
                ),
                *baseline,
            ],
            "Token-weighted fleet figure and the unweighted per-request mean, against the seed "
            "card's per-dataset acceptance lengths.",
        ),
        w=12,
    )
    g.add(
        timeseries(
            "Per-request acceptance length distribution",
            "none",
            [
                target(
                    f"histogram_quantile({q}, sum by (le) "
                    f"(rate({P}spec_accept_length_bucket{{{M}}}[$__rate_interval])))",
                    f"p{int(q * 100)}",
                )
                for q in (0.1, 0.5, 0.9)
            ],
            "Quantiles of per-request acceptance length (1..8).",
        ),
        w=12,
    )
    g.add(
        timeseries(
            "Acceptance length per worker",
            "none",
            [
                target(
                    f"sum by (worker) (rate({P}completion_tokens_total{{{W}}}{R})) / "
                    f"sum by (worker) (rate({P}spec_verify_steps_total{{{W}}}{R}))",
                    "{{worker}} (gateway, token-weighted)",
                ),
                target(f"{P}worker_spec_accept_length{{{W}}}", "{{worker}} (worker-reported)"),
                target(
                    f"max by (worker) ({P}worker_measured_accept_length{{{W}}})",
                    "{{worker}} (gateway EWMA per request, unweighted)",
                ),
            ],
            "A worker far below the others points at a drafter mismatch or misconfiguration; "
            "the gateway flags it as collapsed below routing.collapse_ratio x its peers' median "
            "of the EWMA.",
        ),
        w=12,
    )
    g.add(
        timeseries(
            "Acceptance rate per worker",
            "percentunit",
            [target(f"{P}worker_spec_accept_rate{{{W}}}", "{{worker}}")],
            "Accepted drafts / proposed drafts, as the worker reports it (/v1/loads).",
        ),
        w=12,
    )

    g.row("Throughput")
    g.add(
        timeseries(
            "Output tokens/s by model",
            "short",
            [
                target(
                    f"sum by (model) (rate({P}completion_tokens_total{{{M}}}[$__rate_interval]))",
                    "{{model}} (counter rate)",
                ),
                target(
                    f"sum by (model) ({P}output_throughput_tokens_per_second{{{M}}})",
                    "{{model}} (gateway gauge)",
                ),
            ],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Output tokens/s per worker",
            "short",
            [
                target(
                    f"sum by (worker) (rate({P}completion_tokens_total{{{W}}}[$__rate_interval]))",
                    "{{worker}}",
                ),
                target(
                    f"{P}worker_output_throughput_tokens_per_second{{{W}}}",
                    "{{worker}} (worker gen_throughput)",
                ),
            ],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Prompt and reasoning tokens/s",
            "short",
            [
                target(f"sum(rate({P}prompt_tokens_total{{{M}}}[$__rate_interval]))", "prompt"),
                target(
                    f"sum(rate({P}reasoning_tokens_total{{{M}}}[$__rate_interval]))", "reasoning"
                ),
            ],
        ),
        w=8,
    )

    g.row("Latency")
    g.add(timeseries("Time to first token", "s", quantiles("time_to_first_token_seconds")), w=8)
    g.add(
        timeseries(
            "Inter-chunk time",
            "s",
            quantiles("inter_chunk_seconds"),
            "Gap between relayed chunks; one chunk is usually one verify step.",
        ),
        w=8,
    )
    g.add(timeseries("Time per output token", "s", quantiles("time_per_output_token_seconds")), w=8)
    g.add(timeseries("Request duration", "s", quantiles("request_duration_seconds", "route")), w=12)
    g.add(timeseries("Admission queue wait", "s", quantiles("queue_wait_seconds", match="")), w=12)

    g.row("Prefix cache and routing")
    g.add(
        timeseries(
            "Prefix-cache hit ratio per worker",
            "percentunit",
            [
                target(
                    f"sum by (worker) (rate({P}cached_prompt_tokens_total{{{M},{W}}}{R})) / "
                    f"sum by (worker) (rate({P}prompt_tokens_total{{{M},{W}}}{R}))",
                    "{{worker}}",
                ),
                target(
                    f"sum(rate({P}cached_prompt_tokens_total{{{M}}}{R})) / "
                    f"sum(rate({P}prompt_tokens_total{{{M}}}{R}))",
                    "fleet",
                    "B",
                ),
            ],
            "Of the prompt tokens each worker was sent, those its prefix cache served (the "
            "cached_tokens of its answers; SGLang reports them with --enable-cache-report). "
            "Every miss is prefill the worker recomputed.",
        ),
        w=12,
    )
    g.add(
        timeseries(
            "Why requests went where they did",
            "reqps",
            [
                target(
                    f"sum by (policy, reason) (rate({P}routing_decisions_total{R}))",
                    "{{reason}} ({{policy}})",
                )
            ],
            "cache_aware: cache_hit (the worker holding more of the prompt than the key's home), "
            "affinity (the key's home), spill (the home was past the load bands), no_key, full, "
            "single. Many spills: the fleet is short of capacity for its sessions.",
        ),
        w=12,
    )

    g.row("Traffic and errors")
    g.add(
        timeseries(
            "Requests/s by status",
            "reqps",
            [
                target(
                    f"sum by (status) (rate({P}requests_total{{{M}}}[$__rate_interval]))",
                    "{{status}}",
                )
            ],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Stream outcomes",
            "reqps",
            [
                target(
                    f"sum by (outcome) (rate({P}stream_outcomes_total[$__rate_interval]))",
                    "{{outcome}}",
                )
            ],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Retries, upstream failures, aborts, stream continuations",
            "reqps",
            [
                target(
                    f"sum by (reason) (rate({P}retries_total[$__rate_interval]))",
                    "retry {{reason}}",
                ),
                target(
                    f'sum by (outcome) (rate({P}upstream_attempts_total{{{W}, outcome!="ok"}}'
                    "[$__rate_interval]))",
                    "attempt {{outcome}}",
                ),
                target(f"sum(rate({P}aborts_sent_total[$__rate_interval]))", "aborts sent"),
                target(
                    f"sum by (outcome) (rate({P}stream_continuations_total[$__rate_interval]))",
                    "continuation {{outcome}}",
                ),
            ],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "In flight per worker and queue depth",
            "short",
            [
                target(f"sum by (worker) ({P}in_flight_requests{{{W}}})", "{{worker}}"),
                target(f"sum({P}queue_depth)", "queued"),
            ],
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Worker up and breaker state",
            "short",
            [
                target(f"{P}worker_up{{{W}}}", "up {{worker}}"),
                target(f"{P}worker_breaker_state{{{W}}}", "breaker {{worker}}"),
                target(
                    f"max by (worker) ({P}worker_accept_collapsed{{{W}}})", "collapsed {{worker}}"
                ),
            ],
            "up: 1 healthy, 0 not. breaker: 0 closed, 1 open, 2 half-open. collapsed: 1 when "
            "its acceptance length is far below its peers'.",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Requests/s per API key",
            "reqps",
            [target(f"sum by (key) (rate({P}key_requests_total[$__rate_interval]))", "{{key}}")],
            "Configured key names only.",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Fleet saturation",
            "percentunit",
            [target(f"max({P}fleet_saturation)", "running + queued / capacity")],
            "Requests running or waiting on routable workers plus the admission queue, over the "
            "workers' summed caps; the autoscaling signal (over 100 %: requests queue).",
        ),
        w=8,
    )

    g.row("Tenants")
    for kind, note in (
        ("completion", "Completion tokens (reasoning included) from each answer's usage."),
        ("prompt", "Prompt tokens from each answer's usage."),
        ("reasoning", "Reasoning (thinking) tokens, a part of the completion tokens."),
    ):
        g.add(
            timeseries(
                f"{kind.capitalize()} tokens/s per key",
                "short",
                [
                    target(
                        f"sum by (key) (rate({P}key_{kind}_tokens_total{{{K}}}{R}))",
                        "{{key}}",
                    )
                ],
                f"{note} Configured key names only.",
            ),
            w=8,
        )
    g.add(
        timeseries(
            "Queue wait by priority class",
            "s",
            quantiles("queue_wait_seconds", "priority", match=""),
            "Time requests waited for a worker slot in the admission queue, per priority class "
            "(low, normal, high).",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Quota rejections/s",
            "reqps",
            [
                target(
                    f"sum by (key, quota) (rate({P}quota_rejections_total{{{K}}}{R}))",
                    "{{key}} {{quota}}",
                )
            ],
            "Requests refused with 429 because their key was over tokens_per_min or "
            "tokens_per_day.",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Usage log lines dropped/s",
            "short",
            [
                target(
                    f"sum by (instance) (rate({P}usage_log_dropped_lines_total{R}))",
                    "{{instance}}",
                )
            ],
            "Billing lines lost: the usage log writer fell behind (usage_log_queue) or the disk "
            "failed. Should stay at 0.",
        ),
        w=8,
    )
    g.add(
        timeseries(
            "Limit store errors/s",
            "short",
            [
                target(
                    f"sum by (limit) (rate({P}limit_store_errors_total{R}))",
                    "{{limit}}",
                )
            ],
            "Calls to the shared limit store (limits.redis_url) that failed, by limit: "
            "requests (request rate and concurrency) or tokens (token quotas). Each one let a "
            "request through unlimited (fail open). Should stay at 0.",
        ),
        w=8,
    )

    g.row("Prefill/decode disaggregation")
    g.add(
        timeseries(
            "KV-transfer wait",
            "s",
            quantiles("pd_kv_transfer_wait_seconds", "model"),
            "From a pair's request sent to both workers to the decode worker's first data event, "
            "less the prefill worker's own time: how long decode waited on the KV transfer "
            "(docs/pd.md). Empty without --pd-disaggregation.",
        ),
        w=6,
    )
    g.add(
        timeseries(
            "Prefill queue",
            "short",
            [
                target(
                    f'sum by (worker) ({P}worker_queued_prefill_tokens{{role="prefill",{W}}})',
                    "{{worker}} tokens",
                ),
                target(
                    f'sum by (worker) ({P}worker_waiting_requests{{role="prefill",{W}}})',
                    "{{worker}} requests",
                ),
            ],
            "Prompt tokens and requests each prefill worker reports queued: what least_queued "
            "picks by.",
        ),
        w=6,
    )
    g.add(
        timeseries(
            "Decode running",
            "short",
            [
                target(
                    f'sum by (worker) ({P}worker_running_requests{{role="decode",{W}}})',
                    "{{worker}} running",
                ),
                target(
                    f'sum by (worker) ({P}in_flight_requests{{role="decode",{W}}})',
                    "{{worker}} in flight",
                ),
                target(
                    f'sum by (worker) ({P}worker_kv_transfer_queue_requests{{role="decode",{W}}})',
                    "{{worker}} waiting on transfers",
                ),
            ],
            "Requests each decode worker runs (its batch), the gateway's in flight there (decode "
            "capacity bounds concurrency), and those it holds waiting on a KV transfer.",
        ),
        w=6,
    )
    g.add(
        timeseries(
            "Attempts by role",
            "reqps",
            [
                target(
                    f"sum by (role, outcome) (rate({P}upstream_attempts_total{R}) "
                    f"* on (worker) group_left (role) max by (worker, role) ({P}worker_up))",
                    "{{role}} {{outcome}}",
                )
            ],
            "Upstream attempts by the worker's role and outcome: a prefill failure shows as a "
            "prefill error and a cancelled decode attempt, retried on another pair.",
        ),
        w=6,
    )

    g.row("Workers (SGLang's own metrics)")
    for title, metric, unit in (
        ("SGLang acceptance length", "sglang:spec_accept_length", "none"),
        ("SGLang generation throughput", "sglang:gen_throughput", "short"),
        ("SGLang queued requests", "sglang:num_queue_reqs", "short"),
        ("SGLang KV cache usage", "sglang:token_usage", "percentunit"),
    ):
        g.add(
            timeseries(title, unit, [target(f"sum by (instance) ({metric})", "{{instance}}")]), w=6
        )
    return g.panels


def dashboard() -> dict[str, Any]:
    def variable(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": name},
            "definition": query,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "refresh": 2,
            "sort": 1,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0,
        }

    return {
        "title": "dflash-gateway",
        "uid": "dflash-gateway",
        "description": "DFlash acceptance length, output throughput, latency and health of the "
        "gateway and its SGLang DFLASH workers.",
        "tags": ["dflash", "sglang", "llm"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("model", "Model", f"label_values({P}requests_total, model)"),
                variable("worker", "Worker", f"label_values({P}in_flight_requests, worker)"),
                variable("key", "API key", f"label_values({P}key_requests_total, key)"),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    stale = [p for p in (CANONICAL, COPY) if not p.exists() or p.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is out of date: run python deploy/tools/dashboard.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seed table, the latency summary, and the JSON / PNG outputs of ``bench seed``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest import figures
from loadtest.datasets import CARD
from loadtest.stats import Summary


@dataclass
class DatasetReport:
    dataset: str
    concurrency: int
    requests: int = 0
    failed: int = 0
    accept_length: float = math.nan  # unweighted mean of per-request values (the seed's way)
    accept_source: str = "-"  # exact | estimated
    output_tok_s: float = math.nan
    ttft_ms: Summary | None = None
    itl_ms: Summary | None = None
    e2e_ms: Summary | None = None
    missing: str | None = None  # why the dataset could not run
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        card_tau, card_tps = CARD[self.dataset]
        out: dict[str, Any] = {
            "dataset": self.dataset,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "failed": self.failed,
            "accept_length": _num(self.accept_length),
            "accept_length_estimator": "unweighted mean of per-request values",
            "accept_length_source": self.accept_source,
            "output_tok_s": _num(self.output_tok_s),
            "card_accept_length": card_tau,
            "card_output_tok_s": card_tps,
            "missing": self.missing,
            "errors": self.errors[:10],
        }
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            summary = getattr(self, name)
            out[name] = (
                None if summary is None else {k: _num(v) for k, v in summary.as_dict().items()}
            )
        return out


def _num(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _fmt(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def seed_table(reports: Sequence[DatasetReport]) -> str:
    concurrency = reports[0].concurrency if reports else 32
    header = (
        f"{'dataset':<10} {'accept len':>10} {'card':>5} {'ratio':>6}   "
        f"{f'tok/s @C={concurrency}':>13} {'card':>6} {'ratio':>6}   source"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        card_tau, card_tps = CARD[r.dataset]
        if r.missing:
            lines.append(
                f"{r.dataset:<10} {'missing':>10} {card_tau:>5.1f} {'':>6}   "
                f"{'':>13} {card_tps:>6.0f}          {r.missing}"
            )
            continue
        lines.append(
            f"{r.dataset:<10} {_fmt(r.accept_length, 2):>10} {card_tau:>5.1f} "
            f"{_fmt(r.accept_length / card_tau, 3):>6}   {_fmt(r.output_tok_s, 0):>13} "
            f"{card_tps:>6.0f} {_fmt(r.output_tok_s / card_tps, 3):>6}   {r.accept_source}"
        )
    lines.append(
        "accept len = unweighted mean of per-request spec_accept_length (as the seed's harness); "
        "exact = reported by the worker, estimated = completion tokens / chunks"
    )
    return "\n".join(lines)


def latency_table(reports: Sequence[DatasetReport]) -> str:
    header = f"{'dataset':<10} {'metric':<6} {'mean':>9} {'median':>9} {'p90':>9} {'p99':>9}  (ms)"
    lines = [header, "-" * len(header)]
    for r in reports:
        for name, summary in (("TTFT", r.ttft_ms), ("ITL", r.itl_ms), ("E2E", r.e2e_ms)):
            if summary is None or summary.count == 0:
                continue
            lines.append(
                f"{r.dataset:<10} {name:<6} {summary.mean:>9.1f} {summary.median:>9.1f} "
                f"{summary.p90:>9.1f} {summary.p99:>9.1f}"
            )
    return "\n".join(lines)


def write_json(path: Path, reports: Sequence[DatasetReport], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "datasets": [r.as_dict() for r in reports]}
    path.write_text(json.dumps(data, indent=2) + "\n")


def markdown_table(datasets: Sequence[dict[str, Any]], speed: float | None = None) -> str:
    """The seed table as ``docs/benchmarks.md`` shows it, from ``seed.json``'s datasets;
    ``speed`` (the emulated workers' time scale) divides the measured tok/s."""
    concurrency = datasets[0]["concurrency"] if datasets else 32
    per = f" ÷ {speed:g}" if speed else ""
    lines = [
        f"| dataset | accept length | card | ratio | output tok/s at C={concurrency}{per} | card "
        "| ratio | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d in datasets:
        tau, card_tau = d["accept_length"], d["card_accept_length"]
        tps, card_tps = d["output_tok_s"], d["card_output_tok_s"]
        tps = tps / speed if tps is not None and speed else tps
        if d["missing"] or tau is None or tps is None:
            lines.append(f"| {d['dataset']} | missing | {card_tau:.1f} | | | {card_tps:.0f} | | |")
            continue
        lines.append(
            f"| {d['dataset']} | {tau:.2f} | {card_tau:.1f} | {tau / card_tau:.3f} | {tps:.0f} "
            f"| {card_tps:.0f} | {tps / card_tps:.3f} | {d['failed']} |"
        )
    return "\n".join(lines)


def write_png(
    path: Path, reports: Sequence[DatasetReport], speed: float | None = None
) -> str | None:
    """Bar charts of tok/s and acceptance length per dataset against the card, as PNG or SVG by
    ``path``'s suffix; returns a reason when no chart could be drawn. ``speed``: the emulated
    workers' time scale, by which tok/s is divided to compare with the card."""
    try:
        plt = figures.pyplot()
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    ran = [r for r in reports if not r.missing]
    if not ran:
        return "no dataset ran"
    names = [r.dataset for r in ran]
    xs = range(len(ran))
    fig, (ax_tau, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    ax_tau.bar([x - width / 2 for x in xs], [r.accept_length for r in ran], width, label="measured")
    ax_tau.bar([x + width / 2 for x in xs], [CARD[n][0] for n in names], width, label="seed card")
    ax_tau.set_title("Acceptance length (mean per request)")
    scale = speed or 1.0
    measured = [r.output_tok_s / scale for r in ran]
    ax_tps.bar([x - width / 2 for x in xs], measured, width, label="measured")
    ax_tps.bar([x + width / 2 for x in xs], [CARD[n][1] for n in names], width, label="seed card")
    per = f" ÷ {speed:g} (the emulated workers' --speed)" if speed else ""
    ax_tps.set_title(f"Output tok/s at C={ran[0].concurrency}{per}")
    for ax in (ax_tau, ax_tps):
        ax.set_xticks(list(xs), names)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    fig.tight_layout()
    figures.save(fig, path)
    plt.close(fig)
    return None

"""``bench seed``: the seed model card's table, measured through the gateway.

For each dataset: optional ``/flush_cache`` on the workers, a closed loop at ``--concurrency``
(first C requests are warm-up), then the card's two numbers — acceptance length (unweighted mean
of per-request values) and output tok/s — beside the card's, with their ratio, and a
bench_serving-style latency summary. JSON and a PNG chart are written to ``--out``; ``--docs``
also publishes the chart and the results into ``docs/img/`` and prints the table for
``docs/benchmarks.md`` (``loadtest/figures.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest import datasets, figures, report, runner
from loadtest.processes import PYTHON, ProcessManager
from loadtest.stats import mean, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the gateway (or a worker) to measure"
    )
    p.add_argument("--api-key", help="client API key for the gateway")
    p.add_argument("--model", default="moonshotai/Kimi-K2.5")
    p.add_argument(
        "--datasets",
        default=",".join(datasets.DATASETS),
        help="comma-separated subset of " + ",".join(datasets.DATASETS),
    )
    p.add_argument(
        "--datasets-dir",
        type=Path,
        default=None,
        help="holds gsm8k/test.jsonl and mbpp/sanitized-mbpp.json "
        "(default ../shared/datasets next to the checkout)",
    )
    for name in datasets.DATASETS:
        p.add_argument(f"--{name}-path", type=Path, default=None, help=f"{name} file to use")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--num-prompts",
        type=int,
        default=320,
        help="prompts per dataset including the C warm-up requests",
    )
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--stream",
        action="store_true",
        help="stream responses (acceptance length is then estimated)",
    )
    p.add_argument(
        "--flush-cache-url",
        action="append",
        default=[],
        metavar="WORKER_URL",
        help="POST /flush_cache to this worker before each dataset (repeatable)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="directory for seed.json and seed.png",
    )
    p.add_argument(
        "--docs",
        action="store_true",
        help="also write the plot and results to docs/img/ and print the page's table",
    )
    p.add_argument(
        "--embedded",
        action="store_true",
        help="start the embedded default (gateway + emulated workers) on a free port "
        "and measure it; --base-url is ignored",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=20.0,
        help="with --embedded: the emulated workers' time scale (tok/s scale with it)",
    )


async def _flush(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for url in urls:
            response = await client.post(url.rstrip("/") + "/flush_cache")
            if response.status_code >= 400:
                print(
                    f"warning: {url}/flush_cache answered {response.status_code}", file=sys.stderr
                )


def summarize_dataset(
    name: str, concurrency: int, phase: runner.PhaseResult
) -> report.DatasetReport:
    ok = [r for r in phase.results if r.ok]
    accepts = [r.accept_length for r in ok if r.accept_length is not None]
    sources = {r.accept_source for r in ok if r.accept_source}
    return report.DatasetReport(
        dataset=name,
        concurrency=concurrency,
        requests=len(phase.results),
        failed=len(phase.results) - len(ok),
        accept_length=mean(accepts),
        accept_source="/".join(sorted(sources)) or "-",
        output_tok_s=phase.output_tok_s,
        ttft_ms=summarize([r.ttft_s for r in ok if r.ttft_s is not None]).scaled(1000),
        itl_ms=summarize([g for r in ok for g in r.gaps_s]).scaled(1000),
        e2e_ms=summarize([r.e2e_s for r in ok]).scaled(1000),
        errors=sorted({r.error for r in phase.results if r.error})[:10],
    )


async def run_seed(args: argparse.Namespace) -> list[report.DatasetReport]:
    reports = []
    for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        try:
            data = datasets.load(
                name, path=getattr(args, f"{name}_path"), datasets_dir=args.datasets_dir
            )
        except datasets.DatasetUnavailable as exc:
            reports.append(report.DatasetReport(name, args.concurrency, missing=str(exc)))
            continue
        prompts = data.prompts * math.ceil(args.num_prompts / len(data.prompts))
        prompts = prompts[: args.num_prompts]
        if args.flush_cache_url:
            await _flush(args.flush_cache_url)
        config = runner.RunConfig(
            base_url=args.base_url,
            model=args.model,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
            thinking=args.thinking,
            temperature=args.temperature,
            stream=args.stream,
            api_key=args.api_key,
            profile=data.profile,
        )
        phase = await runner.run(config, prompts, runner.progress_bar(name))
        reports.append(summarize_dataset(name, args.concurrency, phase))
    return reports


def main(args: argparse.Namespace) -> int:
    if not args.embedded:
        return _measure(args)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        procs = ProcessManager(Path(tmp))
        try:
            gateway = procs.start(
                [PYTHON, "-m", "app", "serve", "--port", "{port}"],
                name="gateway",
                ready_path="/readyz",
                ready_status=200,
                timeout=60,
                env={
                    "DFLASH_GATEWAY_EMBEDDED__SPEED": str(args.speed),
                    "DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0",
                },
            )
            args.base_url = gateway.url
            print(
                f"embedded default on {gateway.url}: emulated workers at --speed {args.speed} "
                f"(their tok/s is {args.speed:g}x a real node's; acceptance is unaffected)"
            )
            return _measure(args)
        finally:
            procs.stop_all()


def _measure(args: argparse.Namespace) -> int:
    started = time.time()
    reports = asyncio.run(run_seed(args))
    print(report.seed_table(reports))
    print()
    print(report.latency_table(reports))
    meta: dict[str, Any] = {
        "base_url": args.base_url,
        "model": args.model,
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "thinking": args.thinking,
        "temperature": args.temperature,
        "stream": args.stream,
        "embedded_speed": args.speed if args.embedded else None,
        "started_unix": round(started, 3),
        "duration_s": round(time.time() - started, 3),
        "argv": sys.argv[1:],
    }
    report.write_json(args.out / "seed.json", reports, meta)
    why = report.write_png(args.out / "seed.png", reports, args.speed if args.embedded else None)
    print(
        f"\nwrote {args.out / 'seed.json'}"
        + (f" and {args.out / 'seed.png'}" if why is None else f" (no chart: {why})")
    )
    if args.docs:
        speed = args.speed if args.embedded else None
        why = why or report.write_png(figures.DOCS_IMG / "seed.svg", reports, speed)
        if why is not None:
            print(f"--docs: no plot to publish ({why})", file=sys.stderr)
            return 1
        rows = [r.as_dict() for r in reports]
        data: dict[str, Any] = {"meta": meta, "datasets": rows}
        figures.publish_json("seed", data)
        print(
            f"wrote {figures.DOCS_IMG / 'seed.svg'} and seed.json; the page's table "
            f"(measured {figures.run_date(meta)}):\n"
        )
        print(report.markdown_table(rows, speed))
    failed = sum(r.failed for r in reports)
    if failed:
        print(
            f"{failed} request(s) failed; first errors: "
            f"{[e for r in reports for e in r.errors][:3]}",
            file=sys.stderr,
        )
    ran = [r for r in reports if not r.missing]
    return 0 if ran and not failed else 1

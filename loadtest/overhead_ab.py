"""``bench overhead-ab``: the proxy CPU of two or more gateway builds (and sglang-router), side by
side in one run, for a change too small to see across separate runs on a shared machine.

One emulated worker in ``--replay`` mode, as in ``bench overhead``, and one proxy per
``--trees`` entry: a checkout of the gateway (``PATH``, or ``PATH:N`` for ``--processes N``),
run from that directory; ``--router`` adds sglang-router. All proxies are pinned to the same CPU
and run at once, idle but for the load they are given: one scenario's requests are sent in
``--blocks`` blocks of ``--block`` requests to each proxy in turn (the order reversed every other
block), and each proxy's CPU (utime+stime of its process tree) is summed over its own blocks.
Whatever else the machine does drifts over all of them alike.

Reported per proxy: CPU seconds per 1,000 relayed chunks (streams) or requests, over all blocks
and the median block, each block's figure, failures and TTFT p50. Example (main against a
branch, with the router)::

    python -m loadtest overhead-ab --trees ../main,. --router --scenario non_stream

``--floor`` adds the two reference relays of ``loadtest.floor`` (uvloop + httptools alone, and
uvicorn with a bare ASGI app, both on the gateway's upstream client): what relaying costs on
this stack before any of the gateway's features.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import overhead
from loadtest.processes import PYTHON, ManagedProcess, ProcessManager, free_port
from loadtest.stats import percentile

MODEL = "moonshotai/Kimi-K2.5"
ROUTER = "sglang-router"
FLOORS = ("protocol", "asgi")  # loadtest.floor's reference relays


@dataclass
class Tally:
    cpu_s: float = 0.0
    units: int = 0
    failed: int = 0
    blocks: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def per_1000(self) -> float:
        return self.cpu_s / self.units * 1000 if self.units else 0.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trees", default=".", help="gateway checkouts, comma-separated: PATH[:N]")
    p.add_argument("--router", action="store_true", help="also sglang-router")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also the two reference relays of loadtest.floor (the stack with no features)",
    )
    p.add_argument(
        "--scenario",
        default="non_stream",
        choices=overhead.SCENARIOS,
    )
    p.add_argument("--block", type=int, default=400, help="requests per block")
    p.add_argument(
        "--api-key",
        metavar="NAME:KEY",
        help="configure this one API key on every gateway and send it (the tenant path)",
    )
    p.add_argument("--blocks", type=int, default=6, help="blocks per proxy")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per replayed response")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fanin-concurrency", type=int, default=800, help="streams held open (fan-in)")
    p.add_argument("--proxy-cpu", type=int, default=0, help="CPU the proxies are pinned to")
    p.add_argument("--load-cpu", type=int, default=1, help="CPU for emulator and load generator")


def _scenario(args: argparse.Namespace, requests: int) -> overhead.Scenario:
    return overhead.scenario(args, args.scenario, requests)


def _start(
    procs: ProcessManager, args: argparse.Namespace, emulator: ManagedProcess
) -> dict[str, ManagedProcess]:
    env = overhead.gateway_env(_scenario(args, 1), args.api_key)
    proxies: dict[str, ManagedProcess] = {}
    for spec in args.trees.split(","):
        tree, _, processes = spec.partition(":")
        root = Path(tree).resolve()
        # ``python -m app`` from the checkout's own directory: that checkout's code is run.
        command = (
            f"cd '{root}' && exec {PYTHON} -m app serve --port {{port}} "
            f"--worker-url {emulator.url} --processes {processes or 1}"
        )
        proxies[spec] = procs.start(
            overhead._pin(args.proxy_cpu, ["sh", "-c", command]),
            name=f"gateway-{len(proxies)}",
            ready_path="/readyz",
            ready_status=200,
            env=env,
        )
    if args.floor:
        for kind in FLOORS:
            proxies[f"floor-{kind}"] = procs.start(
                overhead._pin(
                    args.proxy_cpu,
                    [PYTHON, "-m", "loadtest.floor", kind, "{port}", emulator.url],
                ),
                name=f"floor-{kind}",
            )
    if args.router:
        argv = [PYTHON, "-m", "sglang_router.launch_router", "--worker-urls", emulator.url]
        argv += ["--policy", "round_robin", "--host", "127.0.0.1", "--port", "{port}"]
        argv += ["--prometheus-port", str(free_port())]
        proxies[ROUTER] = procs.start(
            overhead._pin(args.proxy_cpu, argv),
            name=ROUTER,
            ready_path="/v1/models",
            ready_status=200,
            timeout=60,
        )
    return proxies


async def measure(args: argparse.Namespace, procs: ProcessManager) -> dict[str, Tally]:
    emulator = overhead.start_emulator(procs, _scenario(args, 1), args.load_cpu)
    proxies = _start(procs, args, emulator)
    warm = _scenario(args, args.concurrency * 4)
    for proxy in proxies.values():
        await overhead.drive(proxy.url, warm, MODEL, args.max_tokens, api_key=args.api_key)
    block = _scenario(args, args.block)
    tallies = {name: Tally() for name in proxies}
    for index in range(args.blocks):
        order = list(proxies) if index % 2 == 0 else list(reversed(proxies))
        for name in order:
            proxy = proxies[name]
            before = overhead.process_tree_cpu(proxy.pid)
            result = await overhead.drive(
                proxy.url, block, MODEL, args.max_tokens, api_key=args.api_key
            )
            cpu = overhead.process_tree_cpu(proxy.pid) - before
            tally = tallies[name]
            tally.cpu_s += cpu
            tally.units += result.unit
            tally.failed += result.failed
            tally.blocks.append(cpu / result.unit * 1000 if result.unit else 0.0)
            tally.ttfts += result.ttfts
    return tallies


def table(args: argparse.Namespace, tallies: dict[str, Tally]) -> str:
    lines = [
        f"{'proxy':<24} {'CPU s/1k':>9} {'median':>7} {'fail':>5} {'TTFT p50':>9}  blocks",
        "-" * 78,
    ]
    for name, t in tallies.items():
        ttft = percentile(sorted(t.ttfts), 50) * 1000 if t.ttfts else 0.0
        blocks = " ".join(f"{b:.4f}" for b in t.blocks)
        lines.append(
            f"{name:<24} {t.per_1000():>9.4f} {statistics.median(t.blocks):>7.4f} "
            f"{t.failed:>5} {ttft:>8.2f}ms  {blocks}"
        )
    unit = "relayed chunks" if _scenario(args, 1).stream else "requests"
    lines.append(f"{args.scenario}: proxy CPU seconds per 1,000 {unit}, blocks interleaved")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    tallies = overhead.run_measured(args.load_cpu, "dflash-overhead-ab-", measure, args)
    print(table(args, tallies))
    return 1 if any(t.failed for t in tallies.values()) else 0

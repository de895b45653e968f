"""``dflash-gateway bench seed|overhead|overhead-ab|routing|fairness`` (also
``python -m loadtest ...``)."""

from __future__ import annotations

import argparse
from typing import Any


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    from loadtest import fairness, overhead, overhead_ab, routing, seed

    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    seed.add_arguments(
        benches.add_parser(
            "seed",
            help="reproduce the seed model card's table through the gateway",
            description=seed.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    overhead.add_arguments(
        benches.add_parser(
            "overhead",
            help="gateway CPU and latency overhead against direct and sglang-router",
            description=overhead.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    overhead_ab.add_arguments(
        benches.add_parser(
            "overhead-ab",
            help="proxy CPU of gateway checkouts (and sglang-router) side by side, interleaved",
            description=overhead_ab.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    routing.add_arguments(
        benches.add_parser(
            "routing",
            help="every routing policy on a heterogeneous and a homogeneous emulated fleet",
            description=routing.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    fairness.add_arguments(
        benches.add_parser(
            "fairness",
            help="one tenant floods, another sends a few at a time: queue wait and TTFT of each",
            description=fairness.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def add_parser(subparsers: Any) -> None:
    add_subcommands(
        subparsers.add_parser(
            "bench",
            help="benchmarks: the seed table, gateway overhead, routing policies, fairness",
            description="Benchmarks against a running gateway (see loadtest/).",
        )
    )


def run(args: argparse.Namespace) -> int:
    if args.bench == "seed":
        from loadtest import seed

        return seed.main(args)
    if args.bench == "routing":
        from loadtest import routing

        return routing.main(args)
    if args.bench == "fairness":
        from loadtest import fairness

        return fairness.main(args)
    if args.bench == "overhead-ab":
        from loadtest import overhead_ab

        return overhead_ab.main(args)
    from loadtest import overhead

    return overhead.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest")
    add_subcommands(parser)
    return run(parser.parse_args(argv))

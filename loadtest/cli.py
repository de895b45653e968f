"""``dflash-gateway bench seed|overhead`` (also ``python -m loadtest seed|overhead``)."""

from __future__ import annotations

import argparse
from typing import Any


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    from loadtest import overhead, seed

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


def add_parser(subparsers: Any) -> None:
    add_subcommands(
        subparsers.add_parser(
            "bench",
            help="benchmarks: the seed table, gateway overhead",
            description="Benchmarks against a running gateway (see loadtest/).",
        )
    )


def run(args: argparse.Namespace) -> int:
    if args.bench == "seed":
        from loadtest import seed

        return seed.main(args)
    from loadtest import overhead

    return overhead.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest")
    add_subcommands(parser)
    return run(parser.parse_args(argv))

"""Command line: ``dflash-gateway serve|emulate|bench`` (also ``python -m app``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app import __version__
from app.config import POLICY_NAMES, ConfigError, load_settings
from app.emulator import cli as emulator_cli
from loadtest.cli import add_parser as add_bench
from loadtest.cli import run as run_bench


def _add_serve(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the gateway",
        description="Run the OpenAI-compatible gateway. With no worker URL and no discovery "
        "configured it starts the embedded default: two emulated SGLang DFLASH workers.",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000)")
    p.add_argument(
        "--worker-url",
        dest="worker_urls",
        action="append",
        metavar="URL",
        help="an SGLang worker base URL, e.g. http://10.0.0.5:30000 (repeatable)",
    )
    p.add_argument("--policy", choices=POLICY_NAMES, help="routing policy (default least_inflight)")
    p.add_argument("--processes", type=int, help="gateway OS processes (default 1)")
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="accept this client API key (repeatable); none configured = open",
    )
    p.add_argument("--config", dest="config_file", metavar="FILE", help="YAML or TOML settings")


def _add_placeholder(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> None:
    p = subparsers.add_parser(name, help=help_text, description=help_text)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-gateway",
        description="OpenAI-compatible gateway for SGLang workers serving Kimi-K2.5 with DFlash.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(subparsers)
    emulator_cli.add_parser(subparsers)
    add_bench(subparsers)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from app.server import serve

    settings = load_settings(
        host=args.host,
        port=args.port,
        worker_urls=args.worker_urls,
        policy=args.policy,
        processes=args.processes,
        api_keys=args.api_keys,
        config_file=args.config_file,
    )
    return serve(settings)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "emulate":
            return emulator_cli.run(args)
        if args.command == "bench":
            return run_bench(args)
    except ConfigError as exc:
        print(f"dflash-gateway: {exc}", file=sys.stderr)
        return 2
    print(f"dflash-gateway {args.command}: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

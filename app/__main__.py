"""Command line: ``dflash-gateway serve|emulate|bench`` (also ``python -m app``).

``PROMETHEUS_MULTIPROC_DIR`` is decided here, before anything imports prometheus_client (which
reads it once, when imported): ``serve`` with ``processes > 1`` gets a fresh private directory
(removed when it ends); every other command, and ``serve`` with one process, runs without it (so
the embedded emulated workers, started as ``python -m app emulate``, never write into the
gateway's directory). This module therefore imports the emulator and the benchmarks lazily.

Commands beyond ``serve`` and ``emulate`` come from the ``dflash_gateway.commands`` entry point
group: each entry point names a module (or object) with ``add_parser(subparsers)`` and
``run(args) -> int``, and its name is the subcommand. The benchmarks (``bench``, package
``loadtest``) register there, so the gateway never imports them, and an install without them
(the container image) simply has no ``bench`` command.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, cast

from app import __version__
from app.config import POLICY_NAMES, ConfigError, Settings, load_settings
from app.workers.config import DecodePolicyName, PrefillPolicyName

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
COMMANDS_GROUP = "dflash_gateway.commands"
BUILTIN_COMMANDS = frozenset({"serve", "emulate"})
SERVE_DESCRIPTION = (
    "Run the OpenAI-compatible gateway. With no worker URL and no discovery configured it starts "
    "the embedded default: two emulated SGLang DFLASH workers."
)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default 8000)")
    p.add_argument(
        "--worker-url",
        dest="worker_urls",
        action="append",
        metavar="URL",
        help="an SGLang worker base URL, e.g. http://10.0.0.5:30000 (repeatable)",
    )
    p.add_argument("--policy", choices=POLICY_NAMES, help="routing policy (default cache_aware)")
    p.add_argument(
        "--processes",
        type=int,
        help="gateway OS processes sharing the port, metrics merged (default 1)",
    )
    p.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="accept this client API key, NAME:KEY or KEY (repeatable); none configured = open. "
        "Visible to every local user in the process list: prefer --api-key-file or "
        "DFLASH_GATEWAY_API_KEYS",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="accept the keys in this file, one NAME:KEY per line, re-read when it changes "
        "(auth.keys_file)",
    )
    p.add_argument(
        "--pd-disaggregation",
        action="store_const",
        const=True,
        help="prefill/decode disaggregation: each request goes to a --prefill and a --decode "
        "worker together (pd.disaggregation; docs/pd.md)",
    )
    p.add_argument(
        "--prefill",
        action="append",
        nargs="+",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill worker and, optionally, its --disaggregation-bootstrap-port "
        "(default pd.bootstrap_port, 8998); repeatable",
    )
    p.add_argument(
        "--decode",
        action="append",
        metavar="URL",
        help="a decode worker base URL (repeatable)",
    )
    p.add_argument(
        "--prefill-policy",
        choices=typing.get_args(PrefillPolicyName),
        help="how the prefill worker is picked (default least_queued)",
    )
    p.add_argument(
        "--decode-policy",
        choices=typing.get_args(DecodePolicyName),
        help="how the decode worker is picked (default spare_capacity)",
    )
    p.add_argument("--config", dest="config_file", metavar="FILE", help="YAML or TOML settings")


def _pd_flags(args: argparse.Namespace) -> dict[str, object] | None:
    """The ``pd`` section the PD flags give (None: none given, the other sources decide)."""
    pd: dict[str, object] = {}
    if args.pd_disaggregation:
        pd["disaggregation"] = True
    if args.prefill:
        for entry in args.prefill:
            if len(entry) > 2:
                raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT], not {' '.join(entry)}")
        pd["prefill"] = [" ".join(entry) for entry in args.prefill]
    if args.decode:
        pd["decode"] = args.decode
    if args.prefill_policy:
        pd["prefill_policy"] = args.prefill_policy
    if args.decode_policy:
        pd["decode_policy"] = args.decode_policy
    return pd or None


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-gateway serve", description=SERVE_DESCRIPTION)
    _serve_arguments(p)
    return p


class Command(Protocol):
    """What a ``dflash_gateway.commands`` entry point loads to."""

    def add_parser(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        """Add exactly one subparser, named as the entry point."""

    def run(self, args: argparse.Namespace) -> int: ...


def discover_commands(
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
) -> dict[str, Command]:
    """Installed subcommands by name, first registration winning. An entry point whose module
    is not installed (or fails to import) is left out: its command does not exist here."""
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=COMMANDS_GROUP)
    commands: dict[str, Command] = {}
    for entry in entry_points:
        if entry.name in BUILTIN_COMMANDS or entry.name in commands:
            continue
        try:
            commands[entry.name] = cast(Command, entry.load())
        except ImportError:
            continue
    return commands


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    from app.emulator import cli as emulator_cli

    if commands is None:
        commands = discover_commands()
    parser = argparse.ArgumentParser(
        prog="dflash-gateway",
        description="OpenAI-compatible gateway for SGLang workers serving Kimi-K2.5 with DFlash.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_arguments(
        subparsers.add_parser("serve", help="run the gateway", description=SERVE_DESCRIPTION)
    )
    emulator_cli.add_parser(subparsers)
    for command in commands.values():
        command.add_parser(subparsers)
    return parser


def _serve(args: argparse.Namespace) -> int:
    settings = load_settings(
        host=args.host,
        port=args.port,
        worker_urls=args.worker_urls,
        policy=args.policy,
        processes=args.processes,
        api_keys=args.api_keys,
        auth={"keys_file": args.api_key_file} if args.api_key_file else None,
        config_file=args.config_file,
        pd=_pd_flags(args),
    )
    if args.api_keys:
        print(
            "dflash-gateway: warning: --api-key puts keys on the command line, readable in /proc "
            "by any local user; use --api-key-file or DFLASH_GATEWAY_API_KEYS instead",
            file=sys.stderr,
        )
    if settings.processes == 1:
        os.environ.pop(MULTIPROC_ENV, None)
        return _run_serve(settings, None)
    if "prometheus_client" in sys.modules:
        raise ConfigError("--processes > 1 must be decided before prometheus_client is imported")
    metrics_dir = Path(tempfile.mkdtemp(prefix="dflash-gateway-metrics-"))
    os.environ[MULTIPROC_ENV] = str(metrics_dir)
    try:
        return _run_serve(settings, metrics_dir)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _run_serve(settings: Settings, metrics_dir: Path | None) -> int:
    from app.server.run import serve

    return serve(settings, metrics_dir=metrics_dir)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:
            return _serve(serve_parser().parse_args(argv[1:]))
        os.environ.pop(MULTIPROC_ENV, None)
        commands = discover_commands()
        args = build_parser(commands).parse_args(argv)
        if args.command == "emulate":
            from app.emulator import cli as emulator_cli

            return emulator_cli.run(args)
        if args.command in commands:
            return commands[args.command].run(args)
    except ConfigError as exc:
        print(f"dflash-gateway: {exc}", file=sys.stderr)
        return 2
    print(f"dflash-gateway {args.command}: not implemented yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

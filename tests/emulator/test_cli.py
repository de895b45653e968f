"""``dflash-gateway emulate`` flags and the listening socket."""

from __future__ import annotations

import socket

import pytest

from app.__main__ import build_parser
from app.emulator.cli import config_from_args
from app.sockets import listen


def test_defaults() -> None:
    config = config_from_args(build_parser().parse_args(["emulate"]))
    assert config.port == 30000 and config.host == "127.0.0.1"
    assert config.model == "moonshotai/Kimi-K2.5"
    assert config.profile == "auto" and config.speed == 1.0
    assert config.max_running_requests == 48 and config.max_queued_requests is None
    assert config.faults.fail_status is None and not config.faults.unhealthy


def test_flags() -> None:
    argv = [
        "emulate", "--port", "31234", "--profile", "mbpp", "--speed", "20",
        "--max-running-requests", "4", "--max-queued-requests", "2", "--warmup-s", "1.5",
        "--fail-status", "502", "--fail-ratio", "0.5", "--die-after-chunks", "3",
        "--inband-error-after-chunks", "4", "--first-byte-delay-s", "0.2", "--unhealthy",
        "--hang-before-first-byte", "--replay", "--no-enable-cache-report",
    ]  # fmt: skip
    config = config_from_args(build_parser().parse_args(argv))
    assert (config.port, config.profile, config.speed) == (31234, "mbpp", 20.0)
    assert (config.max_running_requests, config.max_queued_requests) == (4, 2)
    faults = config.faults
    assert (faults.fail_status, faults.fail_ratio, faults.die_after_chunks) == (502, 0.5, 3)
    assert faults.inband_error_after_chunks == 4 and faults.first_byte_delay_s == 0.2
    assert faults.unhealthy and faults.hang_before_first_byte
    assert config.replay and not config.enable_cache_report


def test_invalid_values_are_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["emulate", "--profile", "nope"])
    with pytest.raises(ValueError, match="speed"):
        config_from_args(build_parser().parse_args(["emulate", "--speed", "0"]))
    with pytest.raises(ValueError, match="fail_ratio"):
        config_from_args(build_parser().parse_args(["emulate", "--fail-ratio", "3"]))


def test_accepted_connections_have_tcp_nodelay() -> None:
    server = listen("127.0.0.1", 0)
    server.setblocking(True)
    try:
        with socket.create_connection(server.getsockname()):
            accepted, _ = server.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        server.close()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], None), (["--accept-collapse"], 1.3), (["--accept-collapse", "2.0"], 2.0)],
)
def test_accept_collapse_flag(argv: list[str], expected: float | None) -> None:
    config = config_from_args(build_parser().parse_args(["emulate", *argv]))
    assert config.faults.accept_collapse == expected


def test_accept_collapse_flag_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="accept_collapse"):
        config_from_args(build_parser().parse_args(["emulate", "--accept-collapse", "9"]))

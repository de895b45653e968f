"""Prefill/decode disaggregation settings and request fields, without processes: the flags (named
after SGLang's, with its defaults), what the emulator refuses, and the room of each generation."""

from __future__ import annotations

import pytest

from app.__main__ import build_parser
from app.emulator.cli import config_from_args
from app.emulator.disagg import DisaggConfig
from app.emulator.genrequest import RequestError
from app.emulator.requests import expand, parse_chat, parse_completion
from app.emulator.worker import EmulatorConfig


def _config(*flags: str) -> EmulatorConfig:
    return config_from_args(build_parser().parse_args(["emulate", *flags]))


def test_defaults_are_sglangs() -> None:
    pd = _config().disagg
    assert (pd.mode, pd.bootstrap_port, pd.transfer_backend) == ("null", 8998, "mooncake")
    assert (pd.bootstrap_timeout_s, pd.waiting_timeout_s) == (300.0, 300.0)
    assert (pd.heartbeat_interval_s, pd.heartbeat_max_failure) == (5.0, 2)
    assert not pd.enabled


def test_flags() -> None:
    pd = _config(
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9000",
        "--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-timeout", "7",
        "--disaggregation-waiting-timeout", "8", "--disaggregation-heartbeat-interval", "0.5",
        "--disaggregation-heartbeat-max-failure", "3",
    ).disagg  # fmt: skip
    assert pd == DisaggConfig("prefill", 9000, "nixl", 7.0, 8.0, 0.5, 3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--disaggregation-mode", "prefill", "--port", "8998"], "must differ"),
        (["--disaggregation-waiting-timeout", "0"], "waiting_timeout_s"),
        (["--disaggregation-heartbeat-max-failure", "0"], "heartbeat_max_failure"),
        (["--disaggregation-mode", "decode", "--engine", "vllm"], "SGLang"),
        (["--disaggregation-mode", "decode", "--replay"], "replay"),
    ],
)
def test_refused_combinations(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*flags)


def test_unknown_mode_or_backend_is_a_usage_error() -> None:
    for flags in (["--disaggregation-mode", "both"], ["--disaggregation-transfer-backend", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["emulate", *flags])


def test_bootstrap_fields_are_read() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "bootstrap_host": "10.0.0.5",
        "bootstrap_port": 8998,
        "bootstrap_room": (1 << 63) - 1,
    }
    req = parse_chat(body)
    assert (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room) == (
        "10.0.0.5",
        8998,
        (1 << 63) - 1,
    )
    assert parse_chat({"messages": body["messages"]}).bootstrap_room is None


@pytest.mark.parametrize(
    "fields",
    [
        {"bootstrap_room": "7"},
        {"bootstrap_room": -1},
        {"bootstrap_room": 1 << 63},
        {"bootstrap_room": True},
        {"bootstrap_port": 0},
        {"bootstrap_port": "8998"},
        {"bootstrap_host": 5},
    ],
)
def test_bad_bootstrap_fields_are_a_400(fields: dict[str, object]) -> None:
    with pytest.raises(RequestError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **fields})
    assert caught.value.status == 400


def test_each_generation_has_its_own_room() -> None:
    """SGLang's ``_normalize_bootstrap_params``: room + i, in the order of the generations."""
    subs = expand(parse_completion({"prompt": ["a", "b"], "n": 2, "bootstrap_room": 40}))
    assert [(s.index, s.bootstrap_room) for s in subs] == [(0, 40), (1, 41), (2, 42), (3, 43)]
    assert [s.bootstrap_room for s in expand(parse_completion({"prompt": "a"}))] == [None]

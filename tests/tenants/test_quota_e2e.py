"""Token quotas on real processes: a gateway with a keys file and a tenants config in front of an
emulated worker, on loopback. A key with a small ``tokens_per_min`` is refused (429 +
Retry-After) once its answers' tokens are spent, another key is not; every answer to a limited
key carries the rate-limit headers, read unchanged by the openai SDK; the Messages door shares
the quota and tells it in Anthropic's names. Then two gateways sharing one real redis-server:
tokens spent through one are refused through the other, and with Redis gone requests are served
and the failures counted."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.security.stack import CHAT, MODEL, chat, emulator, error_of, start_gateway
from tests.support.procs import ManagedProcess, ProcessManager, managed_processes

pytestmark = pytest.mark.processes

KEYS = {
    "team-a": "sk-team-a-0123456789abcdef",  # 50 tokens per minute
    "team-b": "sk-team-b-0123456789abcdef",  # no quota
    "team-sdk": "sk-team-sdk-0123456789abcd",  # 50 tokens per minute
    "team-msg": "sk-team-msg-0123456789abcd",  # 50 tokens per minute
    "team-day": "sk-team-day-0123456789abcd",  # 50 tokens per day
}
# A request below uses 10 prompt + 16 completion tokens on the emulator: the second one spends a
# 50-token quota. A request admitted just before the previous answer was charged may still go
# through (the overshoot the docs describe): loops allow a few.
TENANTS = """\
tenants:
  keys:
    team-a: {tokens_per_min: 50}
    team-sdk: {tokens_per_min: 50}
    team-msg: {tokens_per_min: 50}
    team-day: {tokens_per_day: 50}
limits: {key_rate_per_s: 0.2, key_burst: 10}
"""
TOKENS = ("x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")
REQUESTS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
)
DURATION = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")


def write_config(directory: Path, extra: str = "") -> str:
    keys = directory / "keys"
    keys.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    config = directory / "gateway.yaml"
    config.write_text(f"auth: {{keys_file: {keys}}}\n{TENANTS}{extra}")
    return str(config)


def post(gw: ManagedProcess, key: str, **extra: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[key]}"}
    return httpx.post(gw.url + CHAT, json=chat(**extra), headers=headers, timeout=20)


def spend(gw: ManagedProcess, key: str, tries: int = 6) -> list[httpx.Response]:
    """Requests until the key is refused; all the answers, the refusal last."""
    answers = [post(gw, key)]
    while answers[-1].status_code == 200 and len(answers) < tries:
        answers.append(post(gw, key))
    assert answers[-1].status_code == 429, [a.status_code for a in answers]
    return answers


def refusal(kind: type[Exception], call: Callable[[], object], tries: int = 6) -> Exception:
    """The ``kind`` error an SDK raises once the key is refused (calls until then)."""
    for _ in range(tries):
        try:
            call()
        except kind as exc:
            return exc
    raise AssertionError(f"not refused after {tries} requests")


def metric(gw: ManagedProcess, series: str, missing: float | None = None) -> float:
    ops = {"authorization": f"Bearer {KEYS['team-b']}"}  # keys are set: /metrics needs one
    for line in httpx.get(gw.url + "/metrics", headers=ops, timeout=5).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    if missing is not None:
        return missing
    raise AssertionError(f"{series} not exposed")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManagedProcess]:
    with managed_processes(tmp_path_factory, "quota") as manager:
        config = write_config(tmp_path_factory.mktemp("quota-config"))
        emu = emulator(manager, "emu", "--speed", "50")
        yield start_gateway(manager, [emu], args=("--config", config))


def test_a_key_over_its_tokens_per_minute_is_refused_and_another_is_not(
    gw: ManagedProcess,
) -> None:
    answers = spend(gw, "team-a")
    served, refused = answers[:-1], answers[-1]
    assert 2 <= len(served) <= 3
    retry_after = int(refused.headers["retry-after"])
    assert 1 <= retry_after <= 121
    err = error_of(refused)
    assert (err["type"], err["code"]) == ("rate_limit_exceeded", "rate_limit_exceeded")
    assert "50 tokens per minute" in err["message"]
    assert "try again in" in err["message"]
    # Every answer tells the quota; what is left goes down as answers are charged.
    assert [a.headers["x-ratelimit-limit-tokens"] for a in answers] == ["50"] * len(answers)
    remaining = [int(a.headers["x-ratelimit-remaining-tokens"]) for a in answers]
    assert remaining[0] == 50 and remaining[-1] == 0
    assert remaining == sorted(remaining, reverse=True) and remaining[1] < 50
    assert all(DURATION.match(a.headers["x-ratelimit-reset-tokens"]) for a in answers)
    # The request rate, per minute, on the same answers (0.2/s with a burst of 10).
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"12"}
    left = [int(a.headers["x-ratelimit-remaining-requests"]) for a in answers]
    assert left[0] == 9 and left[-1] < left[0]
    assert post(gw, "team-a").status_code == 429  # still spent
    # Another key: served, with no tokens headers (it has no quota) but its request headers.
    other = post(gw, "team-b")
    assert other.status_code == 200
    assert not set(TOKENS) & set(other.headers)
    assert set(REQUESTS) <= set(other.headers)
    series = 'dflash_gateway_quota_rejections_total{key="team-a",quota="tokens_per_min"}'
    assert metric(gw, series) >= 2
    assert (
        metric(gw, 'dflash_gateway_quota_rejections_total{key="team-b",quota="tokens_per_min"}')
        == 0
    )


def test_streams_and_error_answers_carry_the_headers(gw: ManagedProcess) -> None:
    headers = {"authorization": f"Bearer {KEYS['team-b']}"}
    with httpx.stream(
        "POST", gw.url + CHAT, json=chat(stream=True), headers=headers, timeout=20
    ) as response:
        assert response.status_code == 200
        assert set(REQUESTS) <= set(response.headers)
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    bad = post(gw, "team-b", messages="not a list")
    assert bad.status_code == 400
    assert set(REQUESTS) <= set(bad.headers)
    unknown = post(gw, "team-b", model="no-such-model")
    assert unknown.status_code == 404
    assert set(REQUESTS) <= set(unknown.headers)
    # A key refused by its quota gets them on a stream request's 429 too.
    spend(gw, "team-day")
    with httpx.stream(
        "POST",
        gw.url + CHAT,
        json=chat(stream=True),
        headers={"authorization": f"Bearer {KEYS['team-day']}"},
        timeout=20,
    ) as response:
        assert response.status_code == 429
        assert set(REQUESTS) <= set(response.headers)
        assert not set(TOKENS) & set(response.headers)  # a daily budget only: no tokens headers
        response.read()
        assert "resets at 00:00 UTC" in error_of(response)["message"]
    series = 'dflash_gateway_quota_rejections_total{key="team-day",quota="tokens_per_day"}'
    assert metric(gw, series) >= 2


def test_the_openai_sdk_reads_the_headers_unchanged(gw: ManagedProcess) -> None:
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEYS["team-sdk"], max_retries=0) as sdk:
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.parse().usage is not None
        assert raw.headers["x-ratelimit-limit-tokens"] == "50"
        assert raw.headers["x-ratelimit-remaining-tokens"] == "50"
        assert raw.headers["x-ratelimit-limit-requests"] == "12"
        error = refusal(
            openai.RateLimitError,
            lambda: sdk.chat.completions.create(
                model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}]
            ),
        )
    assert isinstance(error, openai.RateLimitError)
    assert error.response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.code == "rate_limit_exceeded"


def test_the_messages_door_shares_the_quota_and_tells_it_in_anthropic_names(
    gw: ManagedProcess,
) -> None:
    with anthropic.Anthropic(base_url=gw.url, api_key=KEYS["team-msg"], max_retries=0) as sdk:
        raw = sdk.messages.with_raw_response.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.headers["anthropic-ratelimit-tokens-limit"] == "50"
        assert raw.headers["anthropic-ratelimit-requests-limit"] == "12"
        assert re.match(
            r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", raw.headers["anthropic-ratelimit-tokens-reset"]
        )
        assert "x-ratelimit-limit-tokens" not in raw.headers
        post(gw, "team-msg")  # the chat door spends the same key's quota
        error = refusal(
            anthropic.RateLimitError,
            lambda: sdk.messages.create(
                model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}]
            ),
        )
    assert isinstance(error, anthropic.RateLimitError)
    assert error.response.headers["anthropic-ratelimit-tokens-remaining"] == "0"
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


def test_redis_shares_the_quota_between_gateways_and_failing_open_is_counted(
    procs: ProcessManager, redis_url: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path)
    env = {"DFLASH_GATEWAY_LIMITS__REDIS_URL": redis_url}
    emu = emulator(procs, "emu", "--speed", "50")
    first = start_gateway(procs, [emu], args=("--config", config), env=env, name="gateway-1")
    second = start_gateway(procs, [emu], args=("--config", config), env=env, name="gateway-2")
    assert post(second, "team-a").headers["x-ratelimit-remaining-tokens"] == "50"
    spend(first, "team-a")
    refused = post(second, "team-a")  # spent through the first gateway
    assert refused.status_code == 429
    assert refused.headers["x-ratelimit-remaining-tokens"] == "0"
    assert post(second, "team-b").status_code == 200
    # Redis gone: both gateways serve (no quota, no limits), and count each failure.
    [redis] = [p for p in procs.processes if p.name == "redis"]
    redis.kill()
    served = post(first, "team-a")
    assert served.status_code == 200
    assert not set(TOKENS) & set(served.headers)  # nothing known to tell
    assert metric(first, 'dflash_gateway_limit_store_errors_total{limit="tokens"}') >= 1
    assert metric(first, 'dflash_gateway_limit_store_errors_total{limit="requests"}') >= 1
    assert "token-quota store unavailable" in first.logs()


def test_a_whole_answer_the_client_hangs_up_on_spends_the_quota(
    procs: ProcessManager, tmp_path: Path
) -> None:
    """A non-streamed request the client gives up on after 1 s (the emulator, at real speed, had
    generated a couple of hundred tokens by then) spends the key's quota: the next one is
    refused."""
    config = write_config(tmp_path)
    gw = start_gateway(procs, [emulator(procs, "emu")], args=("--config", config))
    headers = {"authorization": f"Bearer {KEYS['team-a']}"}
    long = chat(max_tokens=4000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + CHAT, json=long, headers=headers, timeout=1.0)
    series = f'dflash_gateway_requests_total{{model="{MODEL}",route="{CHAT}",status="499"}}'
    for _ in range(100):  # until the gateway saw the hang-up (the charge follows at once)
        if metric(gw, series, missing=0.0) == 1:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the hang-up was not recorded")
    time.sleep(0.2)
    refused = post(gw, "team-a")
    assert refused.status_code == 429
    assert "50 tokens per minute" in error_of(refused)["message"]

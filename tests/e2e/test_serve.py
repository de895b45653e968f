"""`make run` = `dflash-gateway serve` with the embedded default, and the README's curl command."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import poll
from tests.support.procs import ProcessManager

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__import__("sys").executable).with_name("dflash-gateway")


def readme_curl() -> str:
    """The README's one ``curl -N`` command, its continuation lines included."""
    text = (ROOT / "README.md").read_text()
    assert text.count("\ncurl -N ") == 1, "README should show exactly one curl -N command"
    start = text.index("\ncurl -N ") + 1
    return text[start : text.index("\n```", start)]


def test_make_run_is_serve_with_no_workers() -> None:
    makefile = (ROOT / "Makefile").read_text()
    # PD=1: the same with --pd-disaggregation (one emulated prefill and one decode worker).
    pd = r"\$\(if \$\(PD\),--pd-disaggregation\)"
    assert re.search(rf"^run:.*\n\t\$\(BIN\)/dflash-gateway serve {pd}\s*$", makefile, re.M)


def test_make_run_pd_serves_through_an_emulated_prefill_and_decode_pair(
    procs: ProcessManager,
) -> None:
    env = {"DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0", "DFLASH_GATEWAY_EMBEDDED__SPEED": "20"}
    gw = procs.start(
        [str(SCRIPT), "serve", "--port", "{port}", "--pd-disaggregation"],
        name="serve",
        ready_path="/readyz",
        ready_status=200,
        timeout=60,
        env=env,
    )
    table = httpx.get(gw.url + "/workers", timeout=5).json()["workers"]
    assert sorted(w["role"] for w in table) == ["decode", "prefill"]
    assert poll(lambda: "in PD mode" in gw.logs())
    body = {"model": "kimi-k2.5", "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=60) as response:
        text = "".join(response.iter_text())
    assert response.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    for w in table:  # the pair's room on both emulated workers
        rooms = httpx.get(w["url"] + "/emulator/stats", timeout=5).json()["rooms"]["records"]
        assert len(rooms) == 1, (w["role"], rooms)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_embedded_default_serves_the_readme_curl_and_stops_its_workers(
    procs: ProcessManager,
) -> None:
    # Free ports for the emulated workers so parallel runs do not collide on 30000/30001.
    env = {"DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0", "DFLASH_GATEWAY_EMBEDDED__SPEED": "20"}
    gw = procs.start(
        [str(SCRIPT), "serve", "--port", "{port}"],
        name="serve",
        ready_path="/readyz",
        ready_status=200,
        timeout=60,
        env=env,
    )
    workers = [w["url"] for w in httpx.get(gw.url + "/workers", timeout=5).json()["workers"]]
    assert len(workers) == 2

    command = readme_curl().replace("http://127.0.0.1:8000", gw.url)
    printed = poll(lambda: "curl -N" in gw.logs() and gw.logs())
    assert command in printed  # the banner prints the README's command (with the real port)
    assert f"serving on {gw.url}" in printed

    out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [e for e in out.stdout.split("\n\n") if e.startswith("data: ")]
    assert len(events) > 3
    assert '"reasoning_content"' in out.stdout
    assert events[-1] == "data: [DONE]"

    # SIGTERM to the gateway alone (not its process group): it must stop its workers itself.
    assert gw.popen is not None
    os.kill(gw.pid, signal.SIGTERM)
    assert gw.popen.wait(timeout=30) == 0

    def workers_gone() -> bool:
        for url in workers:
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.TransportError:
                continue
            return False
        return True

    poll(workers_gone, timeout=10)


def test_embedded_default_serves_the_openai_and_anthropic_sdks(procs: ProcessManager) -> None:
    """`make run` as a newcomer points both SDKs at it: each answers, streamed and not."""
    import anthropic
    import openai

    env = {"DFLASH_GATEWAY_EMBEDDED__BASE_PORT": "0", "DFLASH_GATEWAY_EMBEDDED__SPEED": "20"}
    gw = procs.start(
        [str(SCRIPT), "serve", "--port", "{port}"],
        name="serve",
        ready_path="/readyz",
        ready_status=200,
        timeout=60,
        env=env,
    )
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as oai:
        assert oai.models.retrieve("kimi-k2.5").id == "kimi-k2.5"
        chat = oai.chat.completions.create(
            model="kimi-k2.5", messages=[{"role": "user", "content": "Why is the sky blue?"}]
        )
        assert chat.choices[0].message.content
    with anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(
            model="kimi-k2.5",
            max_tokens=512,
            messages=[{"role": "user", "content": "Why is the sky blue?"}],
        )
        assert message.stop_reason in {"end_turn", "max_tokens"}
        kinds = [block.type for block in message.content]
        assert kinds and kinds[0] == "thinking" and set(kinds) <= {"thinking", "text"}
        with claude.messages.stream(
            model="kimi-k2.5",
            max_tokens=512,
            thinking={"type": "disabled"},
            messages=[{"role": "user", "content": "Say hello."}],
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text and final.usage.output_tokens > 0

"""Soak test with locust: streaming chat completions with TTFT reported as its own metric.

    pip install locust
    locust -f loadtest/locustfile.py --headless -u 64 -r 8 -t 30m --host http://127.0.0.1:8000

Environment: ``DFLASH_BENCH_DATASET`` (default gsm8k), ``DFLASH_BENCH_MAX_TOKENS`` (1024),
``DFLASH_BENCH_API_KEY``. Locust's table then shows ``TTFT`` (first content chunk) next to
``chat-stream`` (whole stream), and failures for streams that end without ``[DONE]``.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

from locust import FastHttpUser, events, task

from loadtest.datasets import load

_DATASET = os.environ.get("DFLASH_BENCH_DATASET", "gsm8k")
_PROMPTS = itertools.cycle(load(_DATASET).prompts)
_MAX_TOKENS = int(os.environ.get("DFLASH_BENCH_MAX_TOKENS", "1024"))
_API_KEY = os.environ.get("DFLASH_BENCH_API_KEY")


class ChatUser(FastHttpUser):  # type: ignore[misc]
    @task  # type: ignore[untyped-decorator]
    def chat_stream(self) -> None:
        body = {
            "model": "moonshotai/Kimi-K2.5",
            "messages": [{"role": "user", "content": next(_PROMPTS)}],
            "max_tokens": _MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Content-Type": "application/json", "X-Emulator-Profile": _DATASET}
        if _API_KEY:
            headers["Authorization"] = f"Bearer {_API_KEY}"
        start = time.perf_counter()
        first: float | None = None
        done = False
        with self.client.post(
            "/v1/chat/completions",
            data=json.dumps(body),
            headers=headers,
            stream=True,
            catch_response=True,
            name="chat-stream",
        ) as response:
            for line in response.iter_lines():
                text = line.decode() if isinstance(line, bytes) else str(line)
                if not text.startswith("data:"):
                    continue
                payload = text[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                if first is None and _has_tokens(json.loads(payload)):
                    first = time.perf_counter()
            if not done:
                response.failure("stream ended without [DONE]")
        if first is not None:
            events.request.fire(
                request_type="SSE",
                name="TTFT",
                response_time=(first - start) * 1000,
                response_length=0,
                exception=None,
                context={},
            )


def _has_tokens(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))

"""``--replay``: pre-rendered responses, so overhead benchmarks measure the proxy, not us.

The first request of each shape (endpoint, stream or not, ``max_tokens``, usage chunk, model)
renders a complete response once, with a placeholder id; later requests only splice their rid
into the cached bytes and send them, one SSE event per verify step, paced by
``--replay-chunk-interval-s`` (0 = as fast as the connection takes them). Requests still take a
running slot, can be aborted or disconnected, and leave a ground-truth record; faults and the gate
do not apply.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import orjson

from app.emulator import render
from app.emulator.asgi import SSE_HEADERS, Receive, Send, respond, watch_disconnect
from app.emulator.engine import ActiveRequest, QueueFull
from app.emulator.generation import Generation
from app.emulator.genrequest import UNNAMED_MODEL, GenRequest
from app.emulator.profiles import AcceptanceModel, effective_tau
from app.emulator.worker import EmulatedWorker

_PLACEHOLDER = "@@REPLAY-RID@@"
_PLACEHOLDER_B = _PLACEHOLDER.encode()


@dataclass(frozen=True)
class Template:
    chunks: tuple[bytes, ...]  # SSE events (streams) or one JSON body
    tokens_per_step: tuple[int, ...]
    prompt_tokens: int
    reasoning_tokens: int
    finish_reason: str | None


class ReplayBook:
    """Rendered templates by request shape; owned by one worker."""

    def __init__(self, worker: EmulatedWorker) -> None:
        self._worker = worker
        self._templates: dict[tuple[str, bool, int, bool, str], Template] = {}

    def get(self, kind: str, stream: bool, max_tokens: int, usage: bool, model: str) -> Template:
        key = (kind, stream, max_tokens, usage, model)
        template = self._templates.get(key)
        if template is None:
            template = self._render(*key)
            self._templates[key] = template
        return template

    def _render(
        self, kind: str, stream: bool, max_tokens: int, usage: bool, model: str
    ) -> Template:
        w = self._worker
        profile = "gsm8k" if w.config.profile == "auto" else w.config.profile
        req = GenRequest(
            kind="chat" if kind == "chat" else "completion",
            model=model,
            prompt="replay",
            last_user="replay",
            max_tokens=max_tokens,
            thinking=kind == "chat",
        )
        gen = Generation(req, profile, AcceptanceModel.for_tau(effective_tau(profile, 0)), _rng())
        steps = []
        while (step := gen.next_step()) is not None:
            steps.append(step)
        created = int(w.clock.time())
        cached = 0 if w.config.enable_cache_report else None
        use = render.usage(req.prompt_tokens, gen.completion_tokens, gen.reasoning_tokens, cached)
        chunks: list[bytes] = []
        if not stream and kind == "chat":
            message = {
                "role": "assistant",
                "content": "".join(s.content for s in steps),
                "reasoning_content": "".join(s.reasoning for s in steps) or None,
            }
            choice = render.chat_choice(0, message, gen.finish_reason, gen.matched_stop)
            body = render.chat_response(_PLACEHOLDER, created, model, [choice], use)
            chunks.append(orjson.dumps(body))
        elif not stream:
            text = "".join(s.content for s in steps)
            choice = render.completion_choice(0, text, gen.finish_reason, gen.matched_stop)
            body = render.completion_response(_PLACEHOLDER, created, model, [choice], use)
            chunks.append(orjson.dumps(body))
        elif kind == "chat":
            chat = render.ChatChunks(_PLACEHOLDER, created, model, tools_active=False)
            chunks.append(chat.role())
            for s in steps:
                if s.reasoning:
                    chunks.append(chat.reasoning(s.reasoning))
                if s.content:
                    chunks.append(chat.content(s.content))
            chunks.append(chat.finish(gen.finish_reason or "stop", gen.matched_stop))
            if usage:
                chunks.append(chat.usage(use))
        else:
            text_chunks = render.CompletionChunks(_PLACEHOLDER, created, model)
            for i, s in enumerate(steps):
                last = i == len(steps) - 1
                finish = gen.finish_reason if last else None
                chunks.append(
                    text_chunks.text(s.content, finish, gen.matched_stop if last else None)
                )
            if usage:
                chunks.append(text_chunks.usage({k: v for k, v in use.items() if v is not None}))
        return Template(
            chunks=tuple(chunks),
            tokens_per_step=tuple(gen.step_tokens),
            prompt_tokens=req.prompt_tokens,
            reasoning_tokens=gen.reasoning_tokens,
            finish_reason=gen.finish_reason,
        )


def _rng() -> random.Random:
    return random.Random(20260)


async def handle_replay(
    worker: EmulatedWorker,
    book: ReplayBook,
    kind: str,
    body: dict[str, Any],
    receive: Receive,
    send: Send,
) -> None:
    stream = bool(body.get("stream", False))
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        max_tokens = worker.config.replay_tokens
    options = body.get("stream_options")
    options = options if isinstance(options, dict) else {}
    usage = bool(stream and options.get("include_usage"))
    model = str(body.get("model") or UNNAMED_MODEL)
    template = book.get(kind, stream, max_tokens, usage, model)
    rid = body.get("rid")
    rid = rid if isinstance(rid, str) and rid else f"{worker.rng.getrandbits(128):032x}"
    clock = worker.clock
    priority = body.get("priority")
    priority = priority if isinstance(priority, int) and not isinstance(priority, bool) else None
    active = ActiveRequest(rid, "replay", stream, clock.time(), clock.monotonic(), priority)
    scheduler = worker.scheduler
    scheduler.register(active)
    worker.stats.count("requests")
    watcher = watch_disconnect(receive, lambda: active.abort("disconnect"))
    holding = False
    sent = 0
    try:
        try:
            holding = await scheduler.acquire(active)
        except QueueFull as refused:
            scheduler.unregister(active)  # no record, as for generated requests
            worker.stats.count("queue_rejected")
            await render.send_queue_full(send, stream, refused.message)
            return
        rid_b = rid.encode()
        if not stream:
            body_bytes = template.chunks[0].replace(_PLACEHOLDER_B, rid_b)
            sent = 1
            _finish(worker, active, template, sent, holding)
            holding = False
            await respond(send, 200, body_bytes)
            return
        interval = worker.config.replay_chunk_interval_s
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for chunk in template.chunks:
            if active.aborted:
                break
            if interval:
                await asyncio.sleep(interval)
            data = chunk.replace(_PLACEHOLDER_B, rid_b)
            await send({"type": "http.response.body", "body": data, "more_body": True})
            sent += 1
        _finish(worker, active, template, sent, holding)
        holding = False
        await send({"type": "http.response.body", "body": render.DONE})
    finally:
        watcher.cancel()
        if scheduler.active.get(id(active)) is active:
            _finish(worker, active, template, sent, holding)


def _finish(
    worker: EmulatedWorker, active: ActiveRequest, template: Template, sent: int, holding: bool
) -> None:
    """Release the slot, unregister and record (once: the caller checks registration)."""
    if holding:
        worker.scheduler.release()
    worker.scheduler.unregister(active)
    steps = len(template.tokens_per_step)
    completion = sum(template.tokens_per_step)
    worker.on_tokens(completion, steps)
    now = worker.clock.time()
    worker.stats.add(
        {
            "rid": active.rid,
            "kind": "replay",
            "profile": active.profile,
            "stream": active.stream,
            "steps": steps,
            "tokens_per_step": list(template.tokens_per_step),
            "completion_tokens": completion,
            "reasoning_tokens": template.reasoning_tokens,
            "prompt_tokens": template.prompt_tokens,
            "cached_tokens": 0,
            "prefill_s": 0.0,
            "spec_accept_length": completion / steps if steps else None,
            "finish_reason": "abort" if active.aborted else template.finish_reason,
            "aborted": active.aborted,
            "error": None,
            "chunks_sent": sent,
            "started": active.started,
            "first_token": active.started,
            "finished": now,
        }
    )

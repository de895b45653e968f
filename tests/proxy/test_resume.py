"""``app.proxy.resume``: reading the partial answer, the continuation's body, and the rewrite of
the continuation's events (the processes-level behaviour: tests/e2e/test_continuation.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.errors import UpstreamForeignAnswer, UpstreamStatusError
from app.proxy.resume import Resume, Stream, continuation_body, read_partial
from app.upstream.sse import SSEObserver
from tests.proxy.test_forward import CHAT, chat
from tests.support.gateway import FakeWorker, GatewayHarness

FIRST, RID = "a" * 32, "b" * 32


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def chunk(rid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    return event(
        {
            "id": rid,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


def test_the_partial_answer_is_read_from_whole_events_only() -> None:
    data = (
        chunk(FIRST, {"role": "assistant", "content": ""})
        + chunk(FIRST, {"reasoning_content": "think"})
        + chunk(FIRST, {"reasoning_content": " more"})
        + chunk(FIRST, {"content": "Hello"})
        + b'data: {"id":"'  # an event the client never got
    )
    keep = Stream(chunks=[data[:40], data[40:]])
    part = keep.partial()
    assert (part.id, part.reasoning, part.content, part.steps) == (FIRST, "think more", "Hello", 3)
    assert part.continuable and part.prefix() == "<think>think more</think>Hello"
    assert keep.chunks == [data[: data.rindex(b"data:")]]


def test_reasoning_under_way_stays_open_and_tool_calls_are_not_continued() -> None:
    data = chunk(FIRST, {"role": "assistant"}) + chunk(FIRST, {"reasoning_content": "hm"})
    assert read_partial(data).prefix() == "<think>hm"
    tool = chunk(FIRST, {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]})
    assert not read_partial(data + tool).continuable
    assert not read_partial(data + chunk(FIRST, {}, finish="stop")).continuable


def test_the_continuation_body_adds_the_partial_answer_and_lowers_max_tokens() -> None:
    part = read_partial(
        chunk(FIRST, {"role": "assistant"}) + chunk(FIRST, {"content": "x" * 40}) * 2
    )
    sent = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    body = continuation_body({**sent, "rid": RID}, part)
    assert body["messages"][-1] == {"role": "assistant", "content": "x" * 80}
    assert body["continue_final_message"] is True
    assert body["max_tokens"] == 80 and "rid" not in body
    assert sent["max_tokens"] == 100 and len(sent["messages"]) == 1  # the original is untouched


def test_the_continuation_has_the_first_id_no_role_chunk_and_usage_of_both() -> None:
    resume = Resume(FIRST, streamed_tokens=20)
    resume.rid = RID
    obs = SSEObserver(drop_usage=False)
    obs.first_data = True  # the first attempt committed
    feed = resume.wrap(obs.feed)
    stream = (
        chunk(RID, {"role": "assistant", "content": ""})
        + chunk(RID, {"content": " world"})
        + chunk(RID, {}, finish="stop")
        + event(
            {
                "id": RID,
                "choices": [],
                "usage": {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35},
            }
        )
        + b"data: [DONE]\n\n"
    )
    out = feed(stream[:17]) + feed(stream[17:])
    events = [e for e in out.split(b"\n\n") if e]
    docs = [orjson.loads(e[5:]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]" and obs.done
    assert [d["id"] for d in docs] == [FIRST] * 3
    assert docs[0]["choices"][0]["delta"]["content"] == " world"
    assert docs[-1]["usage"] == {"prompt_tokens": 30, "completion_tokens": 25, "total_tokens": 55}


def test_a_continuation_answering_another_request_is_refused() -> None:
    resume = Resume(FIRST, streamed_tokens=1)
    resume.rid = RID
    with pytest.raises(UpstreamForeignAnswer):
        resume.feed(chunk("c" * 32, {"role": "assistant", "content": ""}))


def test_a_workers_5xx_in_band_error_is_held_back_a_4xx_one_passes() -> None:
    text = chunk(FIRST, {"content": "a"})
    error = b'data: {"error":{"message":"aborted","code":503}}\n\n'
    obs = SSEObserver(drop_usage=False)
    obs.first_data = True
    feed = Stream().keeping(obs.feed, obs)
    assert feed(text + error + b"data: [DONE]\n\n") == text
    assert isinstance(obs.broken, UpstreamStatusError) and obs.broken.status == 503
    assert obs.done and not obs.inband_error  # the relay stops reading there
    obs.resumed()
    assert not obs.done and obs.broken is None
    obs = SSEObserver(drop_usage=False)
    obs.first_data = True
    feed = Stream().keeping(obs.feed, obs)
    bad = b'data: {"error":{"message":"too long","code":400}}\n\n'
    assert feed(text + bad) == text + bad and obs.broken is None and obs.inband_error
    plain = SSEObserver(drop_usage=False)  # a stream that is not continued relays it as before
    plain.first_data = True
    assert plain.feed(text + error) == text + error and plain.broken is None


def test_a_request_continuing_its_own_assistant_message_is_not_continued() -> None:
    part = read_partial(chunk(FIRST, {"role": "assistant"}) + chunk(FIRST, {"content": "x"}))
    own = {"messages": [{"role": "assistant", "content": "Sure"}], "continue_final_message": True}
    assert continuation_body(own, part) is None


async def test_a_worker_gone_silent_is_continued_on_another_with_the_text_so_far() -> None:
    # The first worker pauses after its role chunk and two texts; the idle deadline ends it.
    silent = FakeWorker(hold_after=3, texts=("Hel", "lo", " wor", "ld"))
    other = FakeWorker(texts=(" wor", "ld"))  # what it continues with
    async with GatewayHarness(
        [silent, other], policy="round_robin", timeouts={"idle_s": 0.3}
    ) as gw:
        ex = await gw.post(CHAT, chat(stream=True, max_tokens=50))
    assert ex.status == 200 and not silent.requests[1:]
    (sent,) = other.requests
    assert sent["continue_final_message"] is True
    assert sent["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert sent["max_tokens"] == 48  # 50 less the two chunks streamed
    events = [e for e in ex.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and b'"error"' not in ex.body
    docs = [orjson.loads(e[5:]) for e in events[:-1]]
    assert {d["id"] for d in docs} == {silent.requests[0]["rid"]}
    text = "".join(c["delta"].get("content") or "" for d in docs for c in d["choices"])
    assert text == "Hello world"
    assert [d for d in docs if d["choices"] and d["choices"][0]["delta"].get("role")] == docs[:1]


def test_the_partial_answer_ends_before_a_held_back_error() -> None:
    text = chunk(FIRST, {"role": "assistant"}) + chunk(FIRST, {"content": "Hi"})
    error = b'data: {"error":{"message":"aborted","code":503}}\n\ndata: [DONE]\n\n'
    keep = Stream(chunks=[text + error])
    part = keep.partial()
    assert part.continuable and part.content == "Hi"
    assert keep.chunks == [text]

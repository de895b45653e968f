"""``app.proxy.continuation``: reading the partial answer, the continuation's body, and the
rewrite of the continuation's events (the processes-level behaviour:
tests/e2e/test_continuation.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from app.errors import UpstreamForeignAnswer, UpstreamStatusError
from app.proxy.continuation import KeptReads, Resume
from app.proxy.continuation.partial import continuation_body, read_partial
from app.upstream.sse import SSEObserver
from app.workers.worker import Worker
from tests.metrics.test_metrics import scrape, value
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
    keep = KeptReads(chunks=[data[:40], data[40:]])
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


def _usage_event(prompt: int, completion: int) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return event(
        {"id": RID, "choices": [], "usage": {**usage, "total_tokens": prompt + completion}}
    )


def _broken_stream(worker: str = "w1") -> KeptReads:
    """A stream whose first attempt (prompt body b"{}") relayed a role chunk and two text
    chunks (80 characters: 20 estimated tokens) on ``worker`` and broke."""
    keep = KeptReads()
    keep.chunks.append(
        chunk(FIRST, {"role": "assistant", "content": ""}) + chunk(FIRST, {"content": "x" * 40}) * 2
    )
    keep.broke(Worker(url=f"http://{worker}", name=worker), keep.partial(), b"{}")
    return keep


def test_the_continuation_has_the_first_id_no_role_chunk_and_usage_of_both() -> None:
    keep = _broken_stream()
    keep.legs[0].prompt_tokens = 12  # as the next worker counted the first attempt's prompt
    resume = Resume(FIRST, keep)
    resume.rid = RID
    obs = SSEObserver(drop_usage=False)
    obs.first_data = True  # the first attempt committed
    feed = resume.wrap(obs.feed)
    stream = (
        chunk(RID, {"role": "assistant", "content": ""})
        + chunk(RID, {"content": " world"})
        + chunk(RID, {}, finish="stop")
        # The continuation's prompt: the first one's 12 plus the 18 tokens streamed before.
        + _usage_event(30, 5)
        + b"data: [DONE]\n\n"
    )
    out = feed(stream[:17]) + feed(stream[17:])
    events = [e for e in out.split(b"\n\n") if e]
    docs = [orjson.loads(e[5:]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]" and obs.done
    assert [d["id"] for d in docs] == [FIRST] * 3
    assert docs[0]["choices"][0]["delta"]["content"] == " world"
    # Both prefills (12 + 30), every token streamed (18 before the break, 5 after).
    assert docs[-1]["usage"] == {"prompt_tokens": 42, "completion_tokens": 23, "total_tokens": 65}
    assert resume.usage is not None and resume.usage.exact
    assert resume.usage.continuation_prompt_tokens == 30
    shares = [(w.name if w else None, p, c, s) for w, p, c, s, _ in resume.usage.shares]
    assert shares == [("w1", 12, 18, 2), (None, 30, 5, None)]


def test_without_the_first_prompt_counted_the_streamed_tokens_are_estimated() -> None:
    keep = _broken_stream()  # no worker counted its prompt
    usage = keep.usage(30, 5)
    assert usage is not None and not usage.exact
    assert (usage.prompt_tokens, usage.completion_tokens, usage.continuation_prompt_tokens) == (
        30,
        25,
        0,
    )


def test_two_breaks_credit_each_attempt_with_what_it_streamed() -> None:
    keep = _broken_stream("w1")
    keep.legs[0].prompt_tokens = 10
    keep.chunks.append(chunk(FIRST, {"content": "y" * 40}))
    keep.broke(Worker(url=f"http://{'w2'}", name="w2"), keep.partial(), b"{}")
    keep.legs[1].prompt_tokens = 30  # 10 + the 20 tokens w1 streamed
    usage = keep.usage(37, 4)  # 30 + the 7 tokens w2 streamed
    assert usage is not None and usage.exact
    assert (usage.prompt_tokens, usage.completion_tokens) == (10 + 30 + 37, 20 + 7 + 4)
    shares = [(w.name if w else None, p, c, s) for w, p, c, s, _ in usage.shares]
    assert shares == [("w1", 10, 20, 2), ("w2", 30, 7, 1), (None, 37, 4, None)]


def test_a_continuation_answering_another_request_is_refused() -> None:
    resume = Resume(FIRST, KeptReads())
    resume.rid = RID
    with pytest.raises(UpstreamForeignAnswer):
        resume.feed(chunk("c" * 32, {"role": "assistant", "content": ""}))


def test_a_workers_5xx_in_band_error_is_held_back_a_4xx_one_passes() -> None:
    text = chunk(FIRST, {"content": "a"})
    error = b'data: {"error":{"message":"aborted","code":503}}\n\n'
    obs = SSEObserver(drop_usage=False)
    obs.first_data = True
    feed = KeptReads().keeping(obs.feed, obs)
    assert feed(text + error + b"data: [DONE]\n\n") == text
    assert isinstance(obs.broken, UpstreamStatusError) and obs.broken.status == 503
    assert obs.done and not obs.inband_error  # the relay stops reading there
    obs.resumed()
    assert not obs.done and obs.broken is None
    obs = SSEObserver(drop_usage=False)
    obs.first_data = True
    feed = KeptReads().keeping(obs.feed, obs)
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
    keep = KeptReads(chunks=[text + error])
    part = keep.partial()
    assert part.continuable and part.content == "Hi"
    assert keep.chunks == [text]


async def test_a_continued_stream_counts_every_attempt_each_on_its_own_worker() -> None:
    """The first worker streams three chunks and drops; the second counts the first attempt's
    prompt (4 tokens) and continues: its usage says 7 prompt tokens (4 + the 3 streamed before)
    and 2 completion tokens."""
    first = FakeWorker(die_after=4, texts=("Hel", "lo", " wor", "ld", "!"))
    second = FakeWorker(texts=("ld", "!"), prompt_count=4)
    async with GatewayHarness([first, second], policy="round_robin") as gw:
        ex = await gw.post(CHAT, chat(stream=True, stream_options={"include_usage": True}))
        text = await scrape(gw)
    docs = [orjson.loads(e[5:]) for e in ex.body.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert "".join(c["delta"].get("content") or "" for d in docs for c in d["choices"]) == (
        "Hello world!"
    )
    # Both prefills (4 + 7), every token streamed (3 + 2).
    assert docs[-1]["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    # Each attempt on its own worker: the first prefilled 4 and streamed 3 tokens in 3 steps,
    # the second prefilled 7 and generated 2 in 2 steps.
    for worker, prompt, completion, steps in ((first, 4, 3, 3), (second, 7, 2, 2)):
        assert value(text, "dflash_gateway_prompt_tokens_total", worker=worker.name) == prompt
        done = value(text, "dflash_gateway_completion_tokens_total", worker=worker.name)
        assert done == completion
        assert value(text, "dflash_gateway_spec_verify_steps_total", worker=worker.name) == steps
    assert value(text, "dflash_gateway_spec_accept_length_count", source="estimated") == 2


def _thinking_stream(*deltas: dict[str, Any]) -> KeptReads:
    """A stream whose first attempt on w1 relayed a role chunk and ``deltas``, then broke."""
    keep = KeptReads()
    keep.chunks.append(
        chunk(FIRST, {"role": "assistant", "content": ""})
        + b"".join(chunk(FIRST, d) for d in deltas)
    )
    keep.broke(Worker(url="http://w1", name="w1"), keep.partial(), b"{}")
    return keep


def _continued_usage(keep: KeptReads, usage: dict[str, Any]) -> dict[str, Any]:
    """The usage chunk the client gets for the continuation's ``usage``."""
    resume = Resume(FIRST, keep)
    resume.rid = RID
    out = resume.feed(event({"id": RID, "choices": [], "usage": usage}))
    doc: dict[str, Any] = orjson.loads(out[5:])
    return doc["usage"]  # type: ignore[no-any-return]


def test_an_attempt_broken_while_thinking_streamed_reasoning_only() -> None:
    keep = _thinking_stream({"reasoning_content": "r" * 40}, {"reasoning_content": "r" * 40})
    keep.legs[0].prompt_tokens = 12
    # The continuation: prompt 12 + the 18 tokens streamed before; 5 more, 3 of them reasoning.
    last = {"reasoning_tokens": 3, "completion_tokens_details": {"reasoning_tokens": 3}}
    usage = _continued_usage(keep, {"prompt_tokens": 30, "completion_tokens": 5, **last})
    assert usage["completion_tokens"] == 23
    assert usage["reasoning_tokens"] == 21 and usage["completion_tokens_details"] == {
        "reasoning_tokens": 21
    }
    counted = keep.usage(30, 5, 3)
    assert counted is not None and counted.exact and counted.reasoning_tokens == 21
    assert [s[4] for s in counted.shares] == [18, 3]  # each worker's reasoning tokens


def test_an_attempt_broken_after_the_answer_began_counts_its_reasoning_to_the_think_end() -> None:
    keep = _thinking_stream({"reasoning_content": "r" * 40}, {"content": "x" * 40})
    keep.legs[0].prompt_tokens = 10
    keep.closed = 21  # the first prompt with <think>reasoning</think>: 11 reasoning tokens
    # SGLang counts every token of a continuation begun after the </think> as reasoning (5):
    # it streamed answer only.
    last = {"reasoning_tokens": 5, "completion_tokens_details": None}
    usage = _continued_usage(keep, {"prompt_tokens": 30, "completion_tokens": 5, **last})
    assert usage["completion_tokens"] == 25
    assert usage["reasoning_tokens"] == 11
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 11}
    counted = keep.usage(30, 5, 5)
    assert counted is not None and counted.exact
    assert [s[4] for s in counted.shares] == [11, 0]


def test_without_the_closed_count_the_reasoning_is_estimated() -> None:
    keep = _thinking_stream({"reasoning_content": "r" * 40}, {"content": "x" * 40})
    keep.legs[0].prompt_tokens = 10  # no worker counted the closed reasoning (keep.closed None)
    counted = keep.usage(30, 5, 5)
    assert counted is not None and not counted.exact  # the usage log's tokens_estimated
    assert counted.completion_tokens == 25  # the prompt counts still exact
    assert counted.reasoning_tokens == 11  # 40 characters: 10 tokens, and the </think>


def test_reasoning_over_two_breaks_one_thinking_one_in_the_answer() -> None:
    keep = _thinking_stream({"reasoning_content": "r" * 80})
    keep.legs[0].prompt_tokens = 10  # w1 streamed 20 tokens of reasoning
    keep.chunks.append(
        chunk(FIRST, {"reasoning_content": "r" * 20}) + chunk(FIRST, {"content": "y"})
    )
    keep.broke(Worker(url="http://w2", name="w2"), keep.partial(), b"{}")
    keep.legs[1].prompt_tokens = 30  # w2 streamed 8: the rest of the reasoning, the </think>...
    keep.closed = 36  # ...6 tokens to the </think>, then the answer
    counted = keep.usage(38, 4, 4)
    assert counted is not None and counted.exact
    assert (counted.completion_tokens, counted.reasoning_tokens) == (20 + 8 + 4, 20 + 6 + 0)
    assert [s[4] for s in counted.shares] == [20, 6, 0]


def test_without_prompt_counts_reasoning_streamed_while_thinking_is_estimated() -> None:
    keep = _thinking_stream({"reasoning_content": "r" * 40}, {"reasoning_content": "r" * 40})
    counted = keep.usage(30, 5, 3)  # no worker counted: 80 characters, 20 estimated tokens
    assert counted is not None and not counted.exact
    assert (counted.completion_tokens, counted.reasoning_tokens) == (25, 23)


def test_a_worker_reporting_no_reasoning_gets_none_added() -> None:
    keep = _thinking_stream({"reasoning_content": "r" * 40})
    keep.legs[0].prompt_tokens = 12
    usage = _continued_usage(keep, {"prompt_tokens": 22, "completion_tokens": 5})
    assert usage == {"prompt_tokens": 34, "completion_tokens": 15, "total_tokens": 49}

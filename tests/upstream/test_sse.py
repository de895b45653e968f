from __future__ import annotations

import pytest

from app.errors import UpstreamStatusError
from app.upstream.sse import SSEObserver

ROLE = b'data: {"id":"a","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
TEXT = b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"
ERR = b'data: {"error": {"message": "aborted", "code": 503}}\n\n'


def relay(obs: SSEObserver, chunks: list[bytes]) -> bytes:
    out = b"".join(obs.feed(c) for c in chunks)
    return out + obs.finish()


def test_whole_events_pass_through_as_the_same_object() -> None:
    obs = SSEObserver(drop_usage=False)
    assert obs.feed(ROLE) is ROLE
    assert obs.first_data
    assert obs.feed(TEXT) is TEXT
    assert obs.feed(USAGE) is USAGE
    assert obs.feed(DONE) is DONE
    assert obs.done and obs.usage is not None and obs.usage.completion_tokens == 2


def test_forced_usage_chunk_is_dropped() -> None:
    obs = SSEObserver(drop_usage=True)
    assert relay(obs, [ROLE, TEXT, USAGE, DONE]) == ROLE + TEXT + DONE
    assert obs.usage is not None and obs.usage.prompt_tokens == 3
    obs = SSEObserver(drop_usage=True)
    assert relay(obs, [ROLE, TEXT + USAGE + DONE]) == ROLE + TEXT + DONE
    assert obs.done


def test_events_split_across_reads_are_reassembled() -> None:
    stream = ROLE + TEXT + USAGE + DONE
    for size in (1, 7, 50):
        obs = SSEObserver(drop_usage=True)
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert relay(obs, pieces) == ROLE + TEXT + DONE
        assert obs.done


def test_missing_done_is_noticed() -> None:
    obs = SSEObserver(drop_usage=False)
    relay(obs, [ROLE, TEXT])
    assert not obs.done


def test_comments_before_data_do_not_commit() -> None:
    obs = SSEObserver(drop_usage=False)
    assert obs.feed(b": ping\n\n") == b": ping\n\n"
    assert not obs.first_data


def test_leading_error_event_raises_with_its_code() -> None:
    obs = SSEObserver(drop_usage=False)
    with pytest.raises(UpstreamStatusError) as info:
        obs.feed(b'data: {"error": {"message": "queue full", "code": 503}}\n\n')
    assert info.value.status == 503 and info.value.retryable
    assert info.value.message == "queue full"
    assert not obs.first_data


def test_inband_error_after_commit_is_relayed_and_noted() -> None:
    obs = SSEObserver(drop_usage=False)
    err = b'data: {"error": {"message": "aborted", "code": 503}}\n\n'
    assert relay(obs, [ROLE, err, DONE]) == ROLE + err + DONE
    assert obs.inband_error and obs.done


@pytest.mark.parametrize(
    "reads", [[ROLE, ERR + DONE], [ROLE + TEXT, ERR + DONE], [ROLE + ERR + DONE]]
)
def test_inband_error_read_together_with_done_is_noted(reads: list[bytes]) -> None:
    """SGLang writes its error event and [DONE] back to back: usually one read."""
    obs = SSEObserver(drop_usage=False)
    assert relay(obs, reads) == b"".join(reads)
    assert obs.inband_error and obs.done


# The end of the stream is a whole ``data: [DONE]`` event, never those words inside text.

QUOTED = (
    b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"say data: [DONE]\\n\\n"}}]}\n\n'
)
BARE = b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"data: [DONE]"}}]}\n\n'


@pytest.mark.parametrize("text", [QUOTED, BARE], ids=["with-escaped-newlines", "bare"])
def test_done_inside_the_text_does_not_end_the_stream(text: bytes) -> None:
    for chunks in ([ROLE, text], [ROLE + text], [ROLE, text[:20], text[20:]]):
        obs = SSEObserver(drop_usage=False)
        assert relay(obs, chunks) == ROLE + text
        assert not obs.done  # the stream was cut short: the relay reports it broken
    obs = SSEObserver(drop_usage=False)
    assert relay(obs, [ROLE, text, DONE]) == ROLE + text + DONE
    assert obs.done


def crlf(event: bytes) -> bytes:
    return event.replace(b"\n\n", b"\r\n\r\n")


def test_crlf_delimited_events_are_reassembled_and_ended() -> None:
    stream = crlf(ROLE + TEXT + USAGE + DONE)
    for size in (1, 7, 50, len(stream)):
        obs = SSEObserver(drop_usage=True)
        pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
        assert relay(obs, pieces) == crlf(ROLE + TEXT + DONE)
        assert obs.done and obs.usage is not None and obs.usage.completion_tokens == 2


def test_whole_crlf_events_are_not_held() -> None:
    obs = SSEObserver(drop_usage=False)
    event = crlf(ROLE)
    assert obs.feed(event) is event
    assert obs.feed(crlf(TEXT) + b"data: {") == crlf(TEXT)


def test_an_unfinished_last_event_is_not_relayed() -> None:
    """A stream cut in the middle of an event: the client gets the whole events only, so the
    error event the gateway appends stands on its own line."""
    obs = SSEObserver(drop_usage=False)
    assert relay(obs, [ROLE, TEXT[:30]]) == ROLE
    assert not obs.done


def test_a_last_done_without_its_blank_line_still_ends_the_stream() -> None:
    for tail in (b"data: [DONE]", b"data: [DONE]\n", b"data: [DONE]\r\n"):
        obs = SSEObserver(drop_usage=False)
        out = relay(obs, [ROLE, TEXT + tail])
        assert obs.done
        assert out.endswith(b"data: [DONE]\r\n\r\n" if b"\r" in tail else b"data: [DONE]\n\n")

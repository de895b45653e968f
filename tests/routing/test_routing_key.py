from __future__ import annotations

from typing import Any

import orjson

from app.limits.config import LimitsConfig
from app.proxy.request import Route, parse_request
from app.routing.routing_key import routing_key

SYSTEM = {"role": "system", "content": "You are terse."}


def _key(session: str | None = None, route: Route = Route.CHAT, **body: Any) -> str | None:
    raw = orjson.dumps({"model": "m", **body})
    parsed = parse_request(raw, route, limits=LimitsConfig(), aliases={})
    return routing_key(parsed, session)


def _turns(n: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = [SYSTEM]
    for i in range(n):
        messages.append({"role": "user", "content": f"question {i}"})
        messages.append({"role": "assistant", "content": f"answer {i}"})
    return messages


def test_session_header_wins_over_user_and_conversation() -> None:
    assert _key("abc", user="alice", messages=_turns(1)) == "s:abc"
    assert _key(user="alice", messages=_turns(1)) == "u:alice"


def test_every_turn_of_a_conversation_shares_a_key() -> None:
    keys = {_key(messages=_turns(n)) for n in range(1, 6)}
    assert len(keys) == 1
    assert keys.pop() is not None


def test_different_conversations_get_different_keys() -> None:
    one = _key(messages=[SYSTEM, {"role": "user", "content": "a"}])
    two = _key(messages=[SYSTEM, {"role": "user", "content": "b"}])
    other_system = _key(messages=[{"role": "system", "content": "b"}, {"content": "a"}])
    assert len({one, two, other_system}) == 3
    # Role and content are framed: moving bytes between them changes the key.
    assert _key(messages=[{"role": "user", "content": "ab"}]) != _key(
        messages=[{"role": "system", "content": "userab"}, {"role": "user", "content": ""}]
    )


def test_completions_prompt_and_prompts_without_a_shared_prefix() -> None:
    story = _key(route=Route.COMPLETIONS, prompt="Once upon a time")
    assert story is not None and story.startswith("c:")
    long = "x" * 2100
    assert _key(route=Route.COMPLETIONS, prompt=long + "a") == _key(
        route=Route.COMPLETIONS, prompt=long + "b"
    )  # the first 2 KiB stand in for the shared prefix
    assert _key(route=Route.COMPLETIONS, prompt=[1, 2, 3]) is None
    assert _key(route=Route.COMPLETIONS, prompt=["a", "b"]) is None


def test_keys_are_bounded_in_length() -> None:
    assert len(_key("x" * 10_000, messages=[{}]) or "") <= 258
    assert len(_key(user="u" * 10_000, messages=[{}]) or "") <= 258

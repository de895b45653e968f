from __future__ import annotations

from app.routing.keys import routing_key

SYSTEM = {"role": "system", "content": "You are terse."}


def _turns(n: int) -> list[dict[str, str]]:
    messages: list[dict[str, str]] = [SYSTEM]
    for i in range(n):
        messages.append({"role": "user", "content": f"question {i}"})
        messages.append({"role": "assistant", "content": f"answer {i}"})
    return messages


def test_session_header_wins_over_user_and_conversation() -> None:
    body = {"user": "alice", "messages": _turns(1)}
    assert routing_key(body, session="abc") == "s:abc"
    assert routing_key(body) == "u:alice"


def test_every_turn_of_a_conversation_shares_a_key() -> None:
    keys = {routing_key({"messages": _turns(n)}) for n in range(1, 6)}
    assert len(keys) == 1
    assert keys.pop() is not None


def test_different_conversations_get_different_keys() -> None:
    one = {"messages": [SYSTEM, {"role": "user", "content": "a"}]}
    two = {"messages": [SYSTEM, {"role": "user", "content": "b"}]}
    assert routing_key(one) != routing_key(two)


def test_completions_prompt_and_unusable_bodies() -> None:
    assert routing_key({"prompt": "Once upon a time"}) is not None
    assert routing_key({"messages": "nonsense"}) is None
    assert routing_key({"messages": ["not a dict"]}) is None
    assert routing_key({}) is None


def test_keys_are_bounded_in_length() -> None:
    assert len(routing_key({"x-session-id": "x" * 10_000}, {}) or "") <= 258

"""Model names: aliases and prefix patterns, and the unknown model's message."""

from __future__ import annotations

from app.model_names import resolve, unknown_model

ALIASES = {
    "kimi-k2.5": "moonshotai/Kimi-K2.5",
    "claude-*": "moonshotai/Kimi-K2.5",
    "claude-haiku-*": "small/model",
    "claude-haiku-5-5": "exact/model",
}


def test_an_exact_alias_wins_then_the_longest_pattern() -> None:
    assert resolve(ALIASES, "kimi-k2.5") == "moonshotai/Kimi-K2.5"
    assert resolve(ALIASES, "claude-opus-5-5") == "moonshotai/Kimi-K2.5"
    assert resolve(ALIASES, "claude-haiku-4-9") == "small/model"
    assert resolve(ALIASES, "claude-haiku-5-5") == "exact/model"


def test_a_name_no_alias_matches_stays_itself() -> None:
    assert resolve(ALIASES, "moonshotai/Kimi-K2.5") == "moonshotai/Kimi-K2.5"
    assert resolve(ALIASES, "claude") == "claude"  # "claude-*" needs the dash
    assert resolve(ALIASES, "gpt-6.2-sol") == "gpt-6.2-sol"


def test_the_unknown_models_message_names_what_works() -> None:
    text = unknown_model("gpt-6.2-sol", ["moonshotai/Kimi-K2.5"], ALIASES, "Set X.")
    assert text.startswith("The model `gpt-6.2-sol` does not exist. Use one of: ")
    # Aliases of a model not served are left out: they would 404 too.
    assert "moonshotai/Kimi-K2.5, kimi-k2.5, claude-* (GET /v1/models). Set X." in text


def test_the_message_caps_and_escapes_the_name_sent() -> None:
    text = unknown_model("x\n" + "y" * 500, ["m"], {})
    assert "\n" not in text and "\\n" in text and len(text) < 200

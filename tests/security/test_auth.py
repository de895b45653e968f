from __future__ import annotations

import os
from pathlib import Path

from app.auth import KeyStore, bearer_token, parse_entry


def test_entries_are_named_or_get_a_digest_name() -> None:
    named = parse_entry("team-a:sk-abc")
    bare = parse_entry("sk-xyz")
    assert named is not None
    assert bare is not None
    assert named.name == "team-a"
    assert bare.name.startswith("key-")
    assert "sk-xyz" not in bare.name
    assert parse_entry("# comment") is None
    assert parse_entry("   ") is None


def test_no_keys_means_open() -> None:
    assert KeyStore().open
    assert not KeyStore(["k"]).open


def test_authenticate_by_digest_returns_the_name() -> None:
    store = KeyStore(["team-a:sk-abc", "team-b:sk-def"])
    assert store.authenticate("sk-def") == "team-b"
    assert store.authenticate("sk-abc") == "team-a"
    assert store.authenticate("sk-ab") is None
    assert store.authenticate("") is None
    assert store.authenticate(None) is None
    assert store.names() == ["team-a", "team-b"]


def test_keys_file_is_reloaded_and_revocation_takes_effect(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# client keys\nalpha:sk-1\nbeta:sk-2\n")
    store = KeyStore(keys_file=keys)
    assert not store.open
    assert store.authenticate("sk-2") == "beta"
    assert not store.reload()  # unchanged
    keys.write_text("alpha:sk-1\n")
    os.utime(keys, ns=(1, 1))  # a different stamp even within the same clock tick
    assert store.reload()
    assert store.authenticate("sk-2") is None
    assert store.authenticate("sk-1") == "alpha"


def test_unreadable_keys_file_keeps_the_last_good_set(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alpha:sk-1\n")
    store = KeyStore(keys_file=keys)
    keys.unlink()
    assert not store.reload()
    assert store.authenticate("sk-1") == "alpha"


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer sk-1") == "sk-1"
    assert bearer_token("bearer   sk-1 ") == "sk-1"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None

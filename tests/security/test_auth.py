from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from app.auth.keystore import KeyEntryError, KeyStore, bearer_token, parse_entry
from app.config import ConfigError, load_settings

ABC = "sk-abc-0123456789abcdef"
DEF = "sk-def-0123456789abcdef"
K1 = "sk-1-0123456789abcdef00"
K2 = "sk-2-0123456789abcdef00"


def test_entries_are_named_or_get_a_digest_name() -> None:
    named = parse_entry(f"team-a:{ABC}")
    bare = parse_entry(DEF)
    assert named is not None
    assert bare is not None
    assert named.name == "team-a"
    assert bare.name.startswith("key-")
    assert DEF not in bare.name
    assert parse_entry("# comment") is None
    assert parse_entry("   ") is None


@pytest.mark.parametrize(
    "entry", ["team-b:", "team-b:   ", "team-b:sk-short", "sk-short", "0123456789abcde"]
)
def test_empty_and_short_keys_are_refused(entry: str) -> None:
    with pytest.raises(KeyEntryError, match=r"empty|shorter than 16") as info:
        parse_entry(entry, "keys line 3")
    assert str(info.value).startswith("keys line 3: ")
    key = entry.partition(":")[2].strip() or entry
    assert key == "team-b:" or key not in str(info.value)  # never the key itself
    assert parse_entry("0123456789abcdef") is not None  # 16 characters is enough


def test_a_revoked_line_is_not_a_key_and_stops_start_up(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# client keys\nalpha:{K1}\nteam-b:\n")
    with pytest.raises(KeyEntryError, match=f"{keys} line 3: the key of 'team-b' is empty"):
        KeyStore(keys_file=keys)
    with pytest.raises(ConfigError, match=f"auth.keys_file .*{keys} line 3"):
        load_settings(auth={"keys_file": str(keys)})
    with pytest.raises(ConfigError, match="api_keys entry 2: key shorter than 16") as info:
        load_settings(api_keys=[f"a:{K1}", "b:sk-short"])
    assert "sk-short" not in str(info.value)


def test_short_keys_from_the_environment_stop_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_GATEWAY_API_KEYS", f"a:{K1},team-b:")
    with pytest.raises(ConfigError, match=r"DFLASH_GATEWAY_API_KEYS.*entry 2: the key of 'team-b'"):
        load_settings()


def test_a_reload_with_a_bad_line_keeps_the_previous_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"alpha:{K1}\nbeta:{K2}\n")
    store = KeyStore(keys_file=keys)
    keys.write_text(f"alpha:{K1}\nbeta:\n")
    os.utime(keys, ns=(1, 1))
    with caplog.at_level(logging.ERROR):
        assert not store.reload()
    assert store.authenticate("beta:") is None
    assert store.authenticate(K2) == "beta"  # the previous set, not a half-read one
    assert f"{keys} line 2" in caplog.text
    assert K1 not in caplog.text and K2 not in caplog.text


def test_no_keys_means_open() -> None:
    assert KeyStore().open
    assert not KeyStore([K1]).open


def test_authenticate_by_digest_returns_the_name() -> None:
    store = KeyStore([f"team-a:{ABC}", f"team-b:{DEF}"])
    assert store.authenticate(DEF) == "team-b"
    assert store.authenticate(ABC) == "team-a"
    assert store.authenticate(ABC[:-1]) is None
    assert store.authenticate("") is None
    assert store.authenticate(None) is None
    assert store.names() == ["team-a", "team-b"]


def test_keys_file_is_reloaded_and_revocation_takes_effect(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# client keys\nalpha:{K1}\nbeta:{K2}\n")
    store = KeyStore(keys_file=keys)
    assert not store.open
    assert store.authenticate(K2) == "beta"
    assert not store.reload()  # unchanged
    keys.write_text(f"alpha:{K1}\n")
    os.utime(keys, ns=(1, 1))  # a different stamp even within the same clock tick
    assert store.reload()
    assert store.authenticate(K2) is None
    assert store.authenticate(K1) == "alpha"


def test_unreadable_keys_file_keeps_the_last_good_set(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"alpha:{K1}\n")
    store = KeyStore(keys_file=keys)
    keys.unlink()
    assert not store.reload()
    assert store.authenticate(K1) == "alpha"


def test_bearer_token_parsing() -> None:
    assert bearer_token("Bearer sk-1") == "sk-1"
    assert bearer_token("bearer   sk-1 ") == "sk-1"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None
    assert bearer_token(None) is None

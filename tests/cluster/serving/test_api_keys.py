"""Client API keys (cluster/serving/api_keys.py): where they come from (`router.api_keys`, a
key file, `$PDSERVE_API_KEY`), that no repr, str, dump or message shows one, and the check
every entry point makes."""

from __future__ import annotations

import pickle

import pytest

from cluster.config import ConfigError, ModelConfig
from cluster.errors import InvalidArgument, Unauthenticated
from cluster.serving.api_keys import (
    ENV_VAR,
    REDACTED,
    ApiKey,
    ApiKeys,
    ClientAuth,
    read_key_file,
)
from cluster.serving.app_config import AppConfig, RouterConfig

KEY = "sk-Secret0123456789"
OTHER = "sk-Other9876543210"


def config(**router) -> AppConfig:
    return AppConfig(model=ModelConfig(path="/nonexistent"), router=RouterConfig(**router))


def test_a_key_never_shows_in_repr_str_or_the_dumped_config():
    app = config(api_keys=(KEY,))
    assert app.router.api_keys == (ApiKey(KEY),)
    shown = [repr(app), str(app), repr(app.router.api_keys[0]), f"{app.router.api_keys[0]}"]
    dumped = app.to_dict()
    shown.append(repr(dumped))
    assert all(KEY not in text for text in shown)
    assert dumped["router"]["api_keys"] == [REDACTED]
    # Read back, the placeholder is refused rather than taken for a key.
    with pytest.raises(InvalidArgument, match=r"router\.api_keys\[0\]"):
        AppConfig.from_dict(dumped)


def test_the_dict_form_takes_keys_and_refuses_bad_ones_without_quoting_them():
    app = AppConfig.from_dict({"model": {"path": "x"}, "router": {"api_keys": [KEY, KEY, OTHER]}})
    assert [k.reveal() for k in app.router.api_keys] == [KEY, OTHER]  # duplicates dropped
    bad = "sk has spaces"
    with pytest.raises(InvalidArgument) as e:
        AppConfig.from_dict({"model": {"path": "x"}, "router": {"api_keys": [bad]}})
    assert bad not in e.value.message and "router.api_keys[0]" in e.value.message
    for refused in ("", "x" * 513, "new\nline", "bearer key"):
        with pytest.raises(ConfigError):
            ApiKey(refused)


def test_keys_cross_processes_pickled():
    app = pickle.loads(pickle.dumps(config(api_keys=(KEY,))))
    assert app.router.api_keys[0].reveal() == KEY


def test_key_file_one_a_line_comments_and_blanks_skipped(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# client keys\n\n  {KEY}  \n{OTHER}\n")
    assert [k.reveal() for k in read_key_file(path)] == [KEY, OTHER]


def test_key_file_refusals_name_the_line_not_its_text(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{KEY}\n{KEY} trailing words\n")
    with pytest.raises(ConfigError) as e:
        read_key_file(path)
    assert "line 2" in e.value.message and KEY not in e.value.message
    path.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_key_file(path)
    with pytest.raises(ConfigError, match="api_key_file"):
        read_key_file(tmp_path / "missing")
    path.write_bytes(b"k" * ((1 << 20) + 1))
    with pytest.raises(ConfigError, match="larger than"):
        read_key_file(path)


def test_keys_loaded_from_all_three_sources(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"{OTHER}\n")
    auth = ClientAuth(api_keys=(KEY,), api_key_file=str(path))
    loaded = auth.with_keys_loaded({ENV_VAR: "sk-FromEnv"})
    assert [k.reveal() for k in loaded.api_keys] == [KEY, OTHER, "sk-FromEnv"]
    assert ClientAuth().with_keys_loaded({ENV_VAR: "  "}).api_keys == ()
    assert ClientAuth().with_keys_loaded({}).api_keys == ()
    with pytest.raises(ConfigError) as e:
        ClientAuth().with_keys_loaded({ENV_VAR: "not a key"})
    assert ENV_VAR in e.value.message and "not a key" not in e.value.message


def test_the_built_app_reads_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, KEY)
    app = AppConfig(model=ModelConfig(path="/nonexistent"), mode="colocated")  # no probe
    resolved = app.resolved()
    assert [k.reveal() for k in resolved.router.api_keys] == [KEY]
    assert KEY not in repr(resolved)


def test_tls_files_go_together():
    with pytest.raises(ConfigError, match="together"):
        RouterConfig(tls_cert_file="cert.pem")
    assert RouterConfig(tls_cert_file="c", tls_key_file="k").tls_key_file == "k"


def test_the_check():
    keys = ApiKeys([ApiKey(KEY), ApiKey(OTHER)])
    assert keys.required
    for good in (f"Bearer {KEY}", f"bearer {OTHER}", f"BEARER  {KEY} ", f"Bearer {KEY}".encode()):
        keys.check(good)
    refused = {
        None: "missing",
        "": "missing",
        KEY: "Bearer KEY",
        f"Basic {KEY}": "Bearer KEY",
        f"Bearer {KEY} extra": "Bearer KEY",
        "Bearer sk-wrong": "invalid API key",
        f"Bearer {KEY}x": "invalid API key",
        f"Bearer {KEY[:-1]}": "invalid API key",
        "Bearer ключ": "invalid API key",
    }
    for header, message in refused.items():
        with pytest.raises(Unauthenticated, match=message) as e:
            keys.check(header)
        assert KEY not in e.value.message and e.value.http_status == 401
    open_door = ApiKeys([])
    assert not open_door.required
    open_door.check(None)

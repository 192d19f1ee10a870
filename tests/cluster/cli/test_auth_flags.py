"""`pdserve serve`'s API key and TLS flags reach the router's config, keys from all three
sources; the clients send the key (`$PDSERVE_API_KEY` unless given); no key is printed."""

from __future__ import annotations

from cluster.cli.main import build_parser
from cluster.cli.serve import _config_from_flags
from cluster.client.generation_client import API_KEY_ENV, app_metadata
from cluster.serving import api_keys
from cluster.serving.app_config import AppConfig


def test_serve_flags_reach_the_router_config(tmp_path, monkeypatch):
    keyfile = tmp_path / "keys"
    keyfile.write_text("sk-FromFile\n")
    monkeypatch.setenv(API_KEY_ENV, "sk-FromEnv")
    flags = ["--api-key", "sk-One", "--api-key", "sk-Two", "--api-key-file", str(keyfile)]
    flags += ["--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"]
    config = _config_from_flags(build_parser().parse_args(["serve", "--model", "/m", *flags]))
    router = config.router
    assert [k.reveal() for k in router.api_keys] == ["sk-One", "sk-Two"]
    assert (router.api_key_file, router.tls_cert_file, router.tls_key_file) == (
        str(keyfile),
        "c.pem",
        "k.pem",
    )
    loaded = router.with_keys_loaded()  # what the app builder does
    assert [k.reveal() for k in loaded.api_keys] == [
        "sk-One",
        "sk-Two",
        "sk-FromFile",
        "sk-FromEnv",
    ]
    resolved_text = repr(AppConfig(model=config.model, router=loaded, mode="colocated"))
    assert not any(k in resolved_text for k in ("sk-One", "sk-Two", "sk-FromFile", "sk-FromEnv"))
    plain = _config_from_flags(build_parser().parse_args(["serve", "--model", "/m"]))
    assert plain.router.api_keys == () and plain.router.tls_cert_file == ""


def test_clients_send_the_key_given_or_the_environments(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert app_metadata(None) == ()
    assert app_metadata("app", "sk-1") == (("application", "app"), ("authorization", "Bearer sk-1"))
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert app_metadata(None) == (("authorization", "Bearer sk-env"),)
    assert app_metadata(None, "") == ()  # "" sends none
    assert api_keys.ENV_VAR == API_KEY_ENV  # server and clients read the same variable

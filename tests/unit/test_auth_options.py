"""Which credentials a connection presents (corral_common.auth): explicit file, environment, the
local stack's operator credentials only for a server on this machine, and the three file forms."""
from __future__ import annotations

import os

import pytest

from corral_common import auth


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def test_credentials_forms_and_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv(auth.CREDS_ENV, raising=False)
    assert auth.connect_options("nats://127.0.0.1:4222") == {}  # nothing to present
    pw = _write(str(tmp_path / "pw.creds"), "alice:s3cret\n")
    assert auth.connect_options("nats://h:4222", pw) == {"user": "alice", "password": "s3cret", "inbox_prefix": "_INBOX.alice"}
    jwt = _write(str(tmp_path / "u.creds"), "-----BEGIN NATS USER JWT-----\neyJ...\n------END NATS USER JWT------\n")
    assert auth.connect_options("nats://h:4222", jwt) == {"user_credentials": jwt}
    seed = _write(str(tmp_path / "u.nk"), "SUAxxxx\n")
    assert auth.connect_options("nats://h:4222", seed) == {"nkeys_seed": seed}
    with pytest.raises(ValueError):
        auth.connect_options("nats://h:4222", _write(str(tmp_path / "bad"), "no colon here"))
    # a URL with its own user and password wins over everything, and is passed for every server
    # (a cluster announces more servers, whose URLs carry no password)
    assert auth.connect_options("nats://u:p%40ss@h:4222", pw) == {"user": "u", "password": "p@ss", "inbox_prefix": "_INBOX.u"}
    assert auth.connect_options("nats://h:4222,nats://u:p@h2:4222")["user"] == "u"
    # the environment, then the local stack's operator credentials, for loopback servers only
    monkeypatch.setenv(auth.CREDS_ENV, pw)
    assert auth.connect_options("nats://h:4222")["user"] == "alice"
    monkeypatch.delenv(auth.CREDS_ENV)
    os.makedirs(tmp_path / "state" / auth.AUTH_DIR)
    _write(auth.creds_path("admin", str(tmp_path / "state")), "admin:op\n")
    assert auth.connect_options("nats://127.0.0.1:4222")["user"] == "admin"
    assert auth.connect_options("nats://localhost:4222,nats://127.0.0.1:4223")["user"] == "admin"
    assert auth.connect_options("nats://10.1.2.3:4222") == {}  # never sent to another machine


def test_server_lists_lose_their_passwords():
    assert auth.servers("nats://u:p@a:4222, nats://b:4223,c:4224") == ["nats://a:4222", "nats://b:4223", "nats://c:4224"]
    assert auth.servers("tls://u:p@a:4222") == ["tls://a:4222"]

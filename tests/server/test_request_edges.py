"""The edges a new user (or a hostile client) hits, each refused with a clear 4xx in the
OpenAI error shape (issue 23): duplicate JSON keys, charsets and content codings,
malformed framing, an unbounded ``user``, huge integers echoed in full, a lower-bound
estimate that read like the token count, and a log line before a start-up refusal."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

from kvpage.errors import SpecError
from kvpage.server.config import ServerConfig
from kvpage.server.runner import run_server

pytestmark = pytest.mark.xdist_group("server_request_edges")

URL = "/v1/completions"


@pytest.fixture(scope="module")
def server(serve):
    return serve()


def _raw(server, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        server.base_url + URL,
        content=body,
        headers={"Content-Type": "application/json", **headers},
        timeout=30,
    )


def _socket(server, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; return the status, headers and body of the one response."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_duplicate_json_key_is_refused_naming_the_key(server):
    r = _raw(
        server, b'{"model": "stories260K", "prompt": "hi", "max_tokens": 100000, "max_tokens": 1}'
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "duplicate_key" and err["param"] == "max_tokens", err
    assert "'max_tokens' twice" in err["message"], err
    nested = (
        b'{"model": "stories260K", "messages": [{"role": "user", "content": "a", "content": "b"}]}'
    )
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=nested,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "content", r.text


def test_content_type_charset_other_than_utf8_is_refused_415(server):
    body = b'{"model": "stories260K", "prompt": "hi", "max_tokens": 1}'
    r = _raw(server, body, **{"Content-Type": "application/json; charset=iso-8859-1"})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and "charset 'iso-8859-1'" in err["message"]
    ok = _raw(server, body, **{"Content-Type": 'application/json; charset="UTF-8"'})
    assert ok.status_code == 200, ok.text


def test_content_encoding_other_than_identity_is_refused_415(server):
    body = b'{"model": "stories260K", "prompt": "hi", "max_tokens": 1}'
    r = _raw(server, body, **{"Content-Encoding": "gzip"})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type", err
    assert (
        err["message"].startswith("Content-Encoding: expected identity")
        and "'gzip'" in err["message"]
    )


def test_bad_content_length_gets_the_json_error_body(server):
    status, headers, body = _socket(
        server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n"
    )
    assert status == 400
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["code"] == "invalid_framing" and "bad Content-Length" in err["message"], err


def test_transfer_encoding_gzip_gets_501_with_the_json_error_body(server):
    status, headers, body = _socket(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    )
    assert status == 501 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "invalid_framing"


def test_content_length_with_chunked_is_refused_at_once_not_after_the_body_timeout(server):
    body = b'{"model": "stories260K", "prompt": "hi"}'
    status, headers, raw = _socket(  # the socket's 10 s timeout < body_timeout_s (30 s)
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    )
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(raw)["error"]["code"] == "invalid_framing"


def test_user_field_is_bounded(server):
    r = httpx.post(
        server.base_url + URL,
        json={"model": "stories260K", "prompt": "hi", "user": "u" * 1_000_000},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "user", err
    assert err["message"] == (
        "user: expected a string of at most 256 characters, got 1000000 characters"
    )


@pytest.mark.parametrize("field", ["seed", "max_tokens", "top_k", "min_tokens", "priority"])
def test_huge_integer_is_quoted_at_most_200_characters(server, field):
    big = "9" * 4000
    body = '{"model": "stories260K", "prompt": "hi", "' + field + '": ' + big + "}"
    r = _raw(server, body.encode())
    assert r.status_code == 400, r.text[:300]
    msg = r.json()["error"]["message"]
    assert len(msg) < 450 and big[:201] not in msg, msg[:300]
    assert msg.endswith(" characters)"), msg  # "... (N characters)": got_repr's cut


def test_prompt_too_long_gives_the_real_token_count(server):
    r = httpx.post(
        server.base_url + URL,
        json={"model": "stories260K", "prompt": [1] * 600, "max_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["message"].endswith("got 600")


def test_bad_mode_keys_file_logs_no_configured_line_before_refusing(tmp_path, caplog):
    keys = tmp_path / "keys.yaml"
    keys.write_text("tenants:\n  a:\n    keys: [sk-aaaaaaaaaaaaaaaa]\n")
    keys.chmod(0o644)
    cfg = ServerConfig.model_validate(
        {"port": 0, "security": {"api_keys_file": str(keys)}, "engine_process": False}
    )
    with caplog.at_level(logging.INFO), pytest.raises(SpecError, match="chmod 600"):
        run_server(cfg)
    assert not [r for r in caplog.records if r.name.startswith("kvpage")], caplog.records

"""The dashboard's boundaries: 404 for unknown ids and traversal, the remote-bind token rule,
read-only methods, the loopback Host check, and no token in any log line."""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request

import pytest
from fastapi.testclient import TestClient

from spotrun.orchestrator.cli.main import main
from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.dashboard.security import COOKIE, TOKEN_ENV, BindError, check_bind
from spotrun.orchestrator.dashboard.server import BackgroundServer, resolve_token
from spotrun.orchestrator.ledger.access import ReadOnlyError, open_readonly, redact
from spotrun.orchestrator.ledger.events import AttemptStarted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import open_storage

TOKEN = "0123456789abcdef-test-token"
BASE = "http://127.0.0.1"


@pytest.fixture
def root(tmp_path):
    """A storage root with one job ``ok``; beside it, outside the root, a job-shaped folder and a secret."""
    runs = tmp_path / "runs"
    Ledger(open_storage(f"file://{runs}"), "ok").append(AttemptStarted(attempt=1, world_size=1, pid=1,
                                                                       lineage_id="L"))
    outside = tmp_path / "outside"
    Ledger(open_storage(f"file://{outside}"), "secret").append(AttemptStarted(attempt=1, world_size=1, pid=1,
                                                                              lineage_id="SECRET"))
    os.symlink(outside / "secret", runs / "linked")  # a job folder that is a symlink out of the root
    os.symlink(outside / "secret" / "events" / "000000000000.json", runs / "ok" / "events" / "000000000001.json")
    return runs


@pytest.mark.parametrize("path", [
    "/api/jobs/nope", "/jobs/nope", "/api/jobs/nope/bundles", "/api/jobs/nope/metrics", "/api/jobs/nope/events",
    "/api/jobs/nope/history",
    "/api/jobs/..%2F..", "/api/jobs/..%2Foutside%2Fsecret", "/api/jobs/%2E%2E", "/api/jobs/%2E%2E/history",
    "/jobs/..%2Foutside%2Fsecret", "/api/jobs/%2Fetc%2Fpasswd", "/api/jobs/ok%2F..%2F..%2Foutside%2Fsecret",
    "/api/jobs/.hidden", "/api/jobs/ok%0A", "/api/jobs/linked", "/api/jobs/linked/events", "/jobs/linked",
    "/static/..%2F..%2F..%2Foutside%2Fsecret%2Fevents%2F000000000000.json", "/static/%2E%2E/app.py",
])
def test_unknown_ids_and_traversal_answer_404(root, path):
    client = TestClient(create_app(f"file://{root}"), base_url=BASE)
    response = client.get(path)
    assert response.status_code == 404, (path, response.text[:200])
    assert "SECRET" not in response.text


def test_nothing_outside_the_root_is_listed_or_read(root):
    client = TestClient(create_app(f"file://{root}"), base_url=BASE)
    assert [j["job_id"] for j in client.get("/api/jobs").json()] == ["ok"]  # the symlinked job is not one
    events = client.get("/api/jobs/ok/events").json()
    assert len(events) == 1 and "SECRET" not in str(events)  # the symlinked event file is skipped
    storage = open_readonly(f"file://{root}")
    with pytest.raises(ValueError):
        storage.get("linked/events/000000000000.json")
    with pytest.raises(ReadOnlyError):
        storage.put("ok/x", b"")


@pytest.mark.parametrize("method", ["post", "put", "delete", "patch"])
def test_read_only_methods(root, method):
    client = TestClient(create_app(f"file://{root}"), base_url=BASE)
    assert getattr(client, method)("/api/jobs").status_code == 405


def test_without_a_token_only_loopback_hosts_are_answered(root):
    app = create_app(f"file://{root}")
    for host in ("127.0.0.1:8263", "localhost:8263", "[::1]:8263", "localhost"):
        assert TestClient(app, base_url=f"http://{host}").get("/api/jobs").status_code == 200, host
    response = TestClient(app, base_url="http://attacker.example:8263").get("/api/jobs")
    assert response.status_code == 403  # DNS rebinding: a foreign page resolving its name to 127.0.0.1


def test_security_headers(root):
    response = TestClient(create_app(f"file://{root}"), base_url=BASE).get("/")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"


def test_token_is_checked_on_every_request(root):
    client = TestClient(create_app(f"file://{root}", token=TOKEN), base_url="http://dashboard.example")
    for path in ("/", "/api/jobs", "/jobs/ok", "/labs", "/static/dashboard.css", "/api/jobs/ok/events"):
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong-token-wrong-token"}).status_code == 401
        assert client.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200, path
    for path in (f"/api/jobs?token={TOKEN}", f"/jobs/ok?token={TOKEN}", f"/api/jobs/ok/events?token={TOKEN}"):
        refused = client.get(path, follow_redirects=False)  # a token in a query string ends up in logs
        assert refused.status_code == 401 and "entry page" in refused.text, path
    first = client.get(f"/?token={TOKEN}&x=1", follow_redirects=False)
    assert first.status_code == 303 and first.headers["location"] == "/?x=1"  # the token leaves the URL
    cookie = first.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert "secure" not in cookie  # plain HTTP: a Secure cookie would never come back
    client.cookies.set(COOKIE, TOKEN)
    assert client.get("/jobs/ok").status_code == 200 and client.get("/api/jobs").status_code == 200
    # a token in the query string is refused off the entry page even beside a valid cookie or header
    assert client.get(f"/api/jobs?token={TOKEN}").status_code == 401
    assert client.get(f"/api/jobs?token={TOKEN}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 401


def test_bind_rule():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind(host, allow_remote=False, token=None)
    for host in ("0.0.0.0", "::", "192.168.1.10", "dashboard.example"):
        with pytest.raises(BindError, match="--allow-remote"):
            check_bind(host, allow_remote=False, token=TOKEN)
        with pytest.raises(BindError, match="needs a token"):
            check_bind(host, allow_remote=True, token=None)
        with pytest.raises(BindError, match="at least 16"):
            check_bind(host, allow_remote=True, token="short")
        check_bind(host, allow_remote=True, token=TOKEN)


def test_token_file_env_and_the_deprecated_flag(tmp_path, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment-0123")
    warned: list[str] = []
    file = tmp_path / "token"
    file.write_text(TOKEN + "\nrotated 2026-12-01 by ops\n")  # the first line is the token, the rest is not
    file.chmod(0o600)
    assert resolve_token(str(file), None, warn=warned.append) == TOKEN and warned == []
    assert resolve_token(None, None, warn=warned.append) == "from-the-environment-0123"
    assert resolve_token(None, TOKEN, warn=warned.append) == TOKEN and "deprecated" in warned[-1]
    assert TOKEN not in " ".join(warned)
    file.chmod(0o644)
    resolve_token(str(file), None, warn=warned.append)
    assert "readable by other users" in warned[-1]
    with pytest.raises(BindError, match="cannot read"):
        resolve_token(str(tmp_path / "missing"), None)
    file.write_text("\n")
    with pytest.raises(BindError, match="empty"):
        resolve_token(str(file), None)


def test_cli_refuses_a_remote_bind_before_serving(root, monkeypatch, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    storage = ["--storage", f"file://{root}", "--port", "1"]  # port 1 would fail loudly if it got that far
    assert main(["dashboard", "--host", "0.0.0.0", *storage]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert main(["dashboard", "--host", "0.0.0.0", "--allow-remote", *storage]) == 2
    assert "needs a token" in capsys.readouterr().err
    monkeypatch.setenv(TOKEN_ENV, "short")
    assert main(["dashboard", "--host", "0.0.0.0", "--allow-remote", *storage]) == 2
    assert "short" not in capsys.readouterr().err.replace("at least 16", "")  # never echo a token
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert main(["dashboard", "--host", "0.0.0.0", "--allow-remote", "--tls-cert", str(root), *storage]) == 2
    assert "--tls-key go together" in capsys.readouterr().err
    assert main(["dashboard", "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key", *storage]) == 2
    assert "no such readable file" in capsys.readouterr().err
    assert main(["dashboard", "--storage", f"file://{root / 'missing'}"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_no_token_in_any_log_line(root, caplog):
    caplog.set_level(logging.DEBUG)
    with BackgroundServer(create_app(f"file://{root}", token=TOKEN)) as url:
        for path in (f"/api/jobs?token={TOKEN}", f"/?token={TOKEN}", "/api/jobs"):
            try:
                urllib.request.urlopen(url + path, timeout=10).read()
            except urllib.error.HTTPError as e:
                assert e.code == 401  # no token, or urllib followed the 303 without its cookie
    assert "/api/jobs" in caplog.text  # requests are logged...
    assert TOKEN not in caplog.text  # ...without their query strings


def test_credentials_are_redacted_from_uris():
    assert redact("s3://AKIAXXXX:secretkey@bucket/prefix") == "s3://***@bucket/prefix"
    assert redact("file:///tmp/runs") == "file:///tmp/runs"

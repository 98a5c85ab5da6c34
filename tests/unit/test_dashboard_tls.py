"""The remote dashboard over real HTTPS: a self-signed certificate made here, the token taken from
the entry page's address once (then a ``Secure`` cookie), never from an API query string."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spotrun.orchestrator.dashboard import create_app
from spotrun.orchestrator.dashboard.security import COOKIE
from spotrun.orchestrator.dashboard.server import BackgroundServer
from spotrun.orchestrator.ledger.events import AttemptStarted
from spotrun.orchestrator.ledger.store import Ledger
from spotrun.trainer.storage import open_storage

TOKEN = "0123456789abcdef-tls-token"


def self_signed(tmp_path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture
def served(tmp_path):
    runs = tmp_path / "runs"
    Ledger(open_storage(f"file://{runs}"), "ok").append(AttemptStarted(attempt=1, world_size=1, pid=1,
                                                                       lineage_id="L"))
    cert, key = self_signed(tmp_path)
    with BackgroundServer(create_app(f"file://{runs}", token=TOKEN), tls=(cert, key)) as url:
        yield url, cert


def _get(url: str, cafile: str, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """One HTTPS GET that verifies the server against ``cafile`` and follows no redirect."""
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                       context=ssl.create_default_context(cafile=cafile))
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_dashboard_over_https_with_the_token(served):
    url, cert = served
    assert url.startswith("https://")
    assert _get(url, cert, "/api/jobs").status == 401
    assert _get(url, cert, "/api/jobs", {"Authorization": f"Bearer {TOKEN}"}).status == 200
    assert _get(url, cert, f"/api/jobs?token={TOKEN}").status == 401  # never from an API query string
    first = _get(url, cert, f"/?token={TOKEN}")
    assert first.status == 303 and first.getheader("location") == "/"
    cookie = first.getheader("set-cookie")
    assert "secure" in cookie.lower().split("; ") and "httponly" in cookie.lower()
    assert _get(url, cert, "/jobs/ok", {"Cookie": f"{COOKIE}={TOKEN}"}).status == 200


def test_plain_http_to_the_tls_port_gets_no_page(served):
    url, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("GET", "/api/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        assert response.status != 200
        response.read()
    conn.close()

"""The S3 endpoint as messages show it: user-info removed, whatever the URL's shape (no server needed)."""

from __future__ import annotations

import pytest

from spotrun.trainer.storage import StorageError
from spotrun.trainer.storage.s3 import S3Storage
from spotrun.trainer.storage.s3_errors import safe_endpoint
from tests.helpers.s3 import s3_env  # noqa: F401 - fixture


@pytest.mark.parametrize(("endpoint", "shown"), [
    (None, None),
    ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
    ("http://user:pa55word@host:9000/x", "http://host:9000/x"),
    ("http://user:pa55word@:9000", "http://:9000"),  # user-info but no host
    ("http://user@", "http://"),
])
def test_safe_endpoint_drops_user_info(endpoint, shown):
    assert safe_endpoint(endpoint) == shown


def test_a_hostless_endpoint_with_user_info_is_a_storage_error_that_hides_the_secret(s3_env):
    """Found by mypy: safe_endpoint added a port to ``hostname``, which is None without a host, so the
    StorageError about such an endpoint (and the storage's repr) became a TypeError."""
    with pytest.raises(StorageError) as e:
        S3Storage("s3://bucket/p", "http://user:pa55word@:9000")
    assert str(e.value).startswith("cannot use s3://bucket/p (endpoint http://:9000)")
    assert "pa55word" not in str(e.value)

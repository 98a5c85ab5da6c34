"""An S3-compatible server for the benches: moto on 127.0.0.1, with dummy credentials.

Reuses the test suite's :class:`tests.helpers.s3.MotoServer` (a child process on a
free loopback port). The dummy credentials go into this process's environment
only, so that boto3 never reaches for a real account.
"""

from __future__ import annotations

import os

from tests.helpers.s3 import DUMMY_CREDENTIALS, MotoServer


def local_s3() -> MotoServer:
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    os.environ.update({**DUMMY_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    return MotoServer().start()

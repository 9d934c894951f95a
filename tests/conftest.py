"""Shared pytest fixtures.

``dist``: a session-wide pool of worker processes for real multi-process
torch.distributed (gloo, CPU) tests; see tests/_dist.py.  Workers start lazily on the
first ``dist.run`` and are reused by every test, since spawning per test is too slow.
"""

from __future__ import annotations

import pytest

from _dist import DistPool


@pytest.fixture(scope="session")
def dist():
    pool = DistPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def s3_server():
    """A real SeaweedFS S3 server on 127.0.0.1 with enforced credentials (tests/_s3.py)."""
    from _s3 import S3Server

    server = S3Server().start()
    try:
        yield server
    finally:
        server.close()

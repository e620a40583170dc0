"""A governor URL with no password, against a server that requires one, was reported as a
refused password (audit79 F7): the user gave none, and looked for a typo that was not there."""

from __future__ import annotations

import pytest

from tests.test_shared_governor import start_redis
from tests.test_shared_urls import pool_with

pytestmark = pytest.mark.slow  # a redis-server of its own


def test_a_url_without_the_password_the_server_requires_says_it_has_none(monkeypatch):
    from conductor.execute.shared import check_shared_urls
    from conductor.execute.shared.url import SharedURLError

    server = start_redis(password="rightPW-7731")
    try:
        monkeypatch.setenv("CONDUCTOR_GOVERNOR", f"redis://127.0.0.1:{server.port}/0")
        with pytest.raises(SharedURLError) as e:
            check_shared_urls(pool_with())
        said = str(e.value)
        assert "requires one and the URL gives none" in said and "redis://:PASSWORD@" in said, said
        assert "password or user name" not in said, said
        monkeypatch.setenv("CONDUCTOR_GOVERNOR", f"redis://:wrongPW-5513@127.0.0.1:{server.port}/0")
        with pytest.raises(SharedURLError) as e:  # a password given and wrong is still that
            check_shared_urls(pool_with())
        assert "refused the password or user name" in str(e.value) and "PW-" not in str(e.value)
        monkeypatch.setenv("CONDUCTOR_GOVERNOR", f"redis://127.0.0.1:{server.port}/0?password=wrongPW-5513")
        with pytest.raises(SharedURLError) as e:  # given as a query parameter, as redis-py reads it (review43 2)
            check_shared_urls(pool_with())
        assert "refused the password or user name" in str(e.value) and "PW-" not in str(e.value), str(e.value)
    finally:
        server.stop()

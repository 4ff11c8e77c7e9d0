"""Fixtures shared by every suite."""

from tests.redis_server import redis_client, redis_server, redis_server_factory  # noqa: F401

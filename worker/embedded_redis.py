"""The worker's private ``redis-server``: ``producers.embedded_redis``, where the gateway finds it too."""

from producers.embedded_redis import EmbeddedRedis, find_redis_server, free_port

__all__ = ["EmbeddedRedis", "find_redis_server", "free_port"]

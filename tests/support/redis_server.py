"""The private Redis server of the tests: the plugin's, so users and the project share one."""

from celery_fenced.testing import RedisServer, available_binaries, default_binary

__all__ = ["RedisServer", "available_binaries", "default_binary"]

"""The private Redis server of the tests: the package's harness, so users, the demo, the
benchmarks and the project share one."""

from celery_fenced.harness import RedisServer, available_binaries, default_binary, free_port

__all__ = ["RedisServer", "available_binaries", "default_binary", "free_port"]

"""The tiering tests with T3 run on a real redis-server: tests/t3's fixtures, shared."""

from tests.t3.conftest import make_redis_cluster, redis_cluster, redis_single  # noqa: F401

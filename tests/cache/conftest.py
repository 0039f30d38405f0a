"""The facade tests' ``make_cache`` fixture, for every module of the cache tests."""

from tests.cache.test_facade import make_cache  # noqa: F401 - a fixture

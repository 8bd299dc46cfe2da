"""Fixtures for the data tests that need the prepared ``tiny`` dataset in a private $SLIMKV_CACHE."""

from tests.train.tiny import tiny_cache, tiny_env  # noqa: F401  (fixtures)

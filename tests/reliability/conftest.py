"""Every reliability test sees a private $SLIMKV_CACHE holding the prepared ``tiny`` dataset."""

from tests.train.tiny import tiny_cache, tiny_env  # noqa: F401  (fixtures)

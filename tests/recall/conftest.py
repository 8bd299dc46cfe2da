"""Every test here sees a private $SLIMKV_CACHE holding the prepared ``tiny`` dataset (the prose
needles read it; the sweep tests write runs)."""

from tests.train.tiny import tiny_cache, tiny_env  # noqa: F401  (fixtures)

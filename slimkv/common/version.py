"""The installed slimkv version (one source: the package metadata from pyproject.toml)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("slimkv")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"

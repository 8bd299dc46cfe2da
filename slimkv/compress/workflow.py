"""End-to-end compression of a named pretrained model: load, calibrate, compress, save."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from slimkv.common.version import VERSION
from slimkv.compress.methods import get_method
from slimkv.compress.options import CompressOptions
from slimkv.compress.persist import COMPRESSED_FOLDER, save
from slimkv.compress.pipeline import compress_model
from slimkv.data.texts import MIXED_CALIBRATION, calibration_ids, calibration_sources, calibration_text_sha256
from slimkv.pretrained import LoadedModel, load_pretrained, weights_fingerprint

# The calibration text of `slimkv compress` and the sweep: every calibration source in equal shares
# (drama, scripture, an essayist's dictionary, technical prose), chosen by measurement away from the
# calibration domain (docs/compression.md, "Away from the calibration text").
DEFAULT_CALIB = MIXED_CALIBRATION
DEFAULT_CALIB_TOKENS = 8192
DEFAULT_CALIB_SEQ_LEN = 1024


def calibration_set(loaded: LoadedModel, calib: str, tokens: int, seq_len: int, seed: int,
                    sources: list[tuple[str, list[str]]] | None = None) -> tuple[torch.Tensor, dict]:
    """Calibration windows and their description (source, text hash, token hash) for the manifest.
    ``sources``: ``calibration_sources(calib)`` when the caller already read them."""
    sources = calibration_sources(calib) if sources is None else sources
    ids = calibration_ids(loaded.tokenizer, sources, tokens, seq_len, seed)
    info = {
        "source": calib,
        "sources": [name for name, _docs in sources],
        "text_sha256": calibration_text_sha256(sources),
        "tokens_sha256": hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest(),
        "sequences": ids.shape[0],
        "seq_len": ids.shape[1],
        "tokens": ids.numel(),
        "seed": seed,
    }
    return ids, info


def compress_loaded(loaded: LoadedModel, options: CompressOptions, calib: str, calib_tokens: int, *, calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN,
                    seed: int = 0, progress: bool = True, calibration: tuple[torch.Tensor, dict] | None = None) -> dict:
    """Compress ``loaded.model`` in place; returns the full manifest (without writing anything).

    ``calibration`` (ids, info) from ``calibration_set`` skips re-tokenizing (sweeps share one set).
    """
    options.validate()
    if calib_tokens < 1:
        raise ValueError(f"--calib-tokens must be >= 1; got {calib_tokens}")
    t0 = time.perf_counter()
    if options.method == "svd":
        ids, calib_info = None, {"source": None, "note": "svd uses no calibration data"}
    else:
        ids, calib_info = calibration if calibration is not None else calibration_set(loaded, calib, calib_tokens, calib_seq_len, seed)
    body = compress_model(loaded.model, ids, options, progress=progress)
    identity = dict(loaded.identity)
    if "weights_sha256" not in identity and identity.get("path"):
        identity["weights_sha256"] = weights_fingerprint(Path(identity["path"]))
    return {
        "library_version": VERSION,
        "base_model": identity,
        **body,
        "calibration": calib_info,
        "seconds_total": time.perf_counter() - t0,
    }


def compress_pretrained(model: str, options: CompressOptions, calib: str, calib_tokens: int, out_dir: str | Path | None, *,
                        calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN, seed: int = 0, progress: bool = True) -> tuple[LoadedModel, dict]:
    """Load ``model`` (``smollm2`` or a folder), compress it, and save to ``out_dir`` if given.
    Options, the method, the destination and the calibration text are checked before any work."""
    options.validate()
    get_method(options.method)
    if out_dir is not None:
        COMPRESSED_FOLDER.check(out_dir)
    sources = calibration_sources(calib) if get_method(options.method).needs_data else None
    loaded = load_pretrained(model)
    calibration = None if sources is None else calibration_set(loaded, calib, calib_tokens, calib_seq_len, seed, sources=sources)
    manifest = compress_loaded(loaded, options, calib, calib_tokens, calib_seq_len=calib_seq_len, seed=seed, progress=progress, calibration=calibration)
    if out_dir is not None:
        save(loaded.model, loaded.tokenizer, manifest, out_dir)
    return loaded, manifest

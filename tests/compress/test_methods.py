"""Compression methods live in a registry: a method registered in this file alone (one function +
its registration) compresses, saves and reloads like the built-in ones."""

from __future__ import annotations

import pytest

from slimkv.compress import METHODS, CompressOptions, compress_model, register_method
from slimkv.compress.block import BlockContext
from slimkv.compress.methods import get_method
from tests.compress.helpers import assert_reloads_with_identical_logits

from .conftest import calib_ids, tiny_model


@pytest.fixture
def svd_of_attention_only():
    @register_method("svd-attention", needs_data=False)
    def svd_attention(ctx: BlockContext) -> None:
        """Truncated SVD of the attention projections only; the MLP stays dense."""
        names = [p.name for p in (*ctx.layout.attn_in, ctx.layout.attn_out)]
        for name in names:
            ctx.factor_local(name, "svd", None)
        ctx.install(names)

    yield "svd-attention"
    del METHODS["svd-attention"]


def test_a_registered_method_compresses_saves_and_reloads(svd_of_attention_only, tmp_path):
    model = tiny_model("llama")
    manifest = compress_model(model, None, CompressOptions(method=svd_of_attention_only, ratio=0.3), progress=False)
    replaced = {e["module"].rsplit(".", 2)[-2] + "." + e["module"].rsplit(".", 1)[-1] for e in manifest["modules"]}
    assert replaced == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}
    assert manifest["within_block"] == "none" and manifest["method"] == svd_of_attention_only
    assert_reloads_with_identical_logits(model, manifest, tmp_path / "out", calib_ids(1, 16))


def test_unknown_methods_are_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"method='rootcv' is not a compression method \(did you mean rootcov.*allowed values: svd, asvd, rootcov, latentllm"):
        get_method("rootcv")
    with pytest.raises(ValueError, match="already registered"):
        register_method("svd")(lambda ctx: None)

"""``convert --to kvm`` and ``--to rope-partial`` on tiny random models (no downloads): the RoPE
treatment's bookkeeping is exact when every pair keeps its rotation, a KVM layer whose window
covers the whole sequence computes what the partial-RoPE layer computes, the attention transfer
lowers each layer's output error, the state stops growing, and bad options fail before any work."""

from __future__ import annotations

import json

import pytest
import torch

from slimkv.cli import main
from slimkv.convert import kvm
from slimkv.convert.context import LayerFit
from slimkv.convert.methods import get_conversion, parse_method
from slimkv.convert.pipeline import ConvertOptions, build_converted, convert_pretrained
from slimkv.eval.models import load_language_model
from slimkv.pretrained.loading import CONVERTED_MANIFEST
from tests.compress.conftest import tiny_model
from tests.convert.test_methods import contexts, max_logit_error, perturbed

HEAD_PAIRS = 6  # the tiny Llama's head_dim 12
SMALL_KVM = "kvm:chunk_size=4,window_chunks=2,min_rows=6,sink_len=1,rope_pairs=3,transfer_seq_len=32,transfer_windows=2"


def kvm_options(tmp_path, method: str = SMALL_KVM, **fields) -> ConvertOptions:
    return ConvertOptions(method, calib=str(tmp_path / "calib.txt"), calib_tokens=96, calib_seq_len=32, **fields)


def test_keeping_every_rotated_pair_computes_the_original():
    """Pair selection, reordering and frequencies, with nothing dropped: the original exactly."""
    original = perturbed(tiny_model("llama"))
    source, layers = contexts(original)

    def every_pair(layer, options):
        state, frequencies, info, _ = kvm.fit_rope(layer, HEAD_PAIRS)
        return LayerFit(state, [], info, {"n_kv_heads": 2, "rope": "partial", "rope_fraction": 1.0, "rope_frequencies": frequencies})

    method = get_conversion("rope-partial")
    model, _, _ = build_converted(source, type(method)(**{**method.__dict__, "fit": every_pair}), layers, [{}] * len(layers))
    assert max_logit_error(original, model) < 1e-4
    chosen = [kvm.fit_rope(layer, 2)[2]["rope_pairs_kept"] for layer in layers]
    assert all(len(kept) == 2 and kept == sorted(kept) for kept in chosen)


def test_a_window_covering_the_sequence_is_the_partial_rope_model():
    """Until a chunk leaves the window the state is never read: kvm one-shot = rope-partial, logit for logit."""
    original = perturbed(tiny_model("llama"))
    source, layers = contexts(original)
    _, rope_settings = parse_method("rope-partial:rope_pairs=3")
    _, kvm_settings = parse_method("kvm:chunk_size=16,window_chunks=4,rope_pairs=3,transfer_steps=0")
    partial, _, _ = build_converted(source, get_conversion("rope-partial"), layers, [rope_settings] * len(layers))
    bounded, _, _ = build_converted(source, get_conversion("kvm"), layers, [kvm_settings] * len(layers))
    ids = torch.randint(3, 99, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(bounded(ids).logits, partial(ids).logits, atol=1e-5)
        assert not torch.allclose(partial(ids).logits, original(ids).logits, atol=1e-3)  # dropping rotations costs something


def test_kvm_end_to_end_transfer_lowers_every_layers_error_and_the_state_stays_flat(tiny_folder, tmp_path):
    out = tmp_path / "out"
    model, manifest = convert_pretrained(str(tiny_folder), kvm_options(tmp_path, SMALL_KVM + ",transfer_steps=25,transfer_lr=0.05"), out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    assert stored["method"] == "kvm" and stored["kind"] == "kvm" and stored["cache_ratio"] is None
    assert stored["method_options"]["min_rows"] == 6 and stored["achieved_cache_ratio"] is None
    layers = stored["refinement"]["layers"]
    assert len(layers) == 2 and all(layer["relative_error_after"] < layer["relative_error_before"] for layer in layers)
    table = stored["cache_bytes"]
    assert table[0]["bytes"] == model.cache_bytes(table[0]["context"]) and len({row["bytes"] for row in table}) == 1  # flat past the window
    config = json.loads((out / "config.json").read_text())
    assert all(len(o["rope_frequencies"]) == 3 and o["rope_fraction"] == 0.5 for o in config["per_layer_options"])
    reloaded = load_language_model(str(out))
    ids = torch.randint(3, 99, (1, 40))
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids).logits, model(ids).logits)
    assert "kvm" in reloaded.identity["converted"]["method"]


@pytest.mark.parametrize("method, ratio, message", [
    ("kvm:rope_pairs=6", None, r"--to kvm: rope_pairs=6 must be an integer from 1 to 5"),
    ("rope-partial:rope_pairs=6", None, r"--to rope-partial: rope_pairs=6 must be an integer from 1 to 5"),
    ("kvm:rope_pairs=0", None, r"rope_pairs=0 must be an integer from 1 to 5"),
    ("kvm:rope_pairs=3,min_rows=0", None, r"min_rows must be an integer >= 1"),
    ("kvm:rope_pairs=3,rows=256", None, r"--to kvm: the option 'rows' is now spelled 'min_rows'"),
    ("kvm:rope_pairs=3,chunk_size=64", None, r"the window \(chunk_size x window_chunks = 128 tokens\) must be shorter than the model's 128 positions"),
    ("kvm:rope_pairs=3,chunk_size=4,sink_len=1,transfer_seq_len=12", None, r"transfer_seq_len must be an integer >= 16"),
    ("kvm:rope_pairs=3,schedule=daily", None, r"schedule='daily' is not allowed"),
    ("kvm:window=3", None, r"'window' is not an option of kvm.*allowed options: chunk_size"),
    ("kvm:rope_pairs=3", 0.5, r"--to kvm takes no --cache-ratio"),
    ("mla", None, r"--to mla needs --cache-ratio"),
    ("mla-kvm", None, r"--to mla-kvm needs --cache-ratio"),
    ("mla+kvm", 0.5, r"--to mla\+kvm is now spelled --to mla-kvm"),
    ("mla-kvm:rope_pairs=3", 0.5, r"'rope_pairs' is not an option of mla-kvm.*allowed options: chunk_size"),
    ("mla-kvm:min_rows=0", 0.5, r"--to mla-kvm: min_rows must be an integer >= 1"),
    ("mla-kvm:rows=2", 0.5, r"the option 'rows' is now spelled 'min_rows'"),
    ("mla-kvm:chunk_size=64", 0.5, r"--to mla-kvm: the window \(chunk_size x window_chunks = 128 tokens\) must be shorter"),
    ("mla:rank=3", 0.5, r"'rank' is not an option of mla.*allowed options: pairs"),
    ("gqa:rank=3", 0.5, r"'rank' is not an option of gqa.*it takes no options"),
    ("latent:weighting=plain", 0.5, r"--to latent: weighting='plain' is not allowed.*output, rootcov"),
    ("latent:kv_balance=0", 0.5, r"--to latent: kv_balance must be"),
    ("latent", None, r"--to latent needs --cache-ratio"),
    ("lrkv:rope_placement=sideways", 0.5, r"--to lrkv: rope_placement='sideways' is not allowed; allowed values: full, decoupled"),
    ("lrkv:rope=decoupled", 0.5, r"--to lrkv: the option 'rope' is now spelled 'rope_placement'"),
    ("lrkv:rope_pairs=2", 0.5, r"--to lrkv: rope_pairs=2 applies only with rope_placement=decoupled"),
    ("lrkv:rope_placement=decoupled,rope_pairs=6", 0.5, r"--to lrkv: rope_pairs=6 must be an integer from 1 to 5"),
])
def test_bad_options_fail_before_any_work(tiny_folder, tmp_path, method, ratio, message):
    with pytest.raises(ValueError, match=message):
        convert_pretrained(str(tiny_folder), kvm_options(tmp_path, method, cache_ratio=ratio), tmp_path / "never", progress=False)
    assert not (tmp_path / "never").exists()


def test_the_cli_refuses_a_healing_window_the_state_never_reaches(tiny_folder, tmp_path):
    args = ["convert", "--model", str(tiny_folder), "--to", SMALL_KVM, "--calib", str(tmp_path / "calib.txt"), "--calib-tokens", "96",
            "--calib-seq-len", "32", "--heal-tokens", "64", "--heal-text", str(tmp_path / "calib.txt"), "--heal-seq-len", "12", "--out", str(tmp_path / "never")]
    assert main(args) == 2
    assert not (tmp_path / "never").exists()


SMALL_MLA_KVM = "mla-kvm:chunk_size=4,window_chunks=2,min_rows=6,sink_len=1,transfer_seq_len=32,transfer_windows=2"


def test_mla_kvm_with_a_window_covering_the_sequence_is_the_mla_conversion():
    """mla-kvm one-shot reads only its window until a chunk leaves it: the mla conversion at the
    same ratio, logit for logit; with a short window the state changes the late tokens only."""
    original = perturbed(tiny_model("llama"))
    source, layers = contexts(original)
    mla_plans, _ = get_conversion("mla").plan(layers, 0.5)
    _, wide = parse_method("mla-kvm:chunk_size=16,window_chunks=4,transfer_steps=0")
    _, narrow = parse_method("mla-kvm:chunk_size=4,window_chunks=2,min_rows=6,sink_len=1,transfer_steps=0")
    plain, _, _ = build_converted(source, get_conversion("mla"), layers, mla_plans)
    method = get_conversion("mla-kvm")
    whole, _, _ = build_converted(source, method, layers, method.plan(layers, 0.5, **wide)[0])
    bounded, _, _ = build_converted(source, method, layers, method.plan(layers, 0.5, **narrow)[0])
    ids = torch.randint(3, 99, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference, cut = plain(ids).logits, bounded(ids).logits
        assert torch.allclose(whole(ids).logits, reference, atol=1e-5)
    assert torch.allclose(cut[:, :8], reference[:, :8], atol=1e-5) and not torch.allclose(cut[:, 12:], reference[:, 12:], atol=1e-3)


def test_mla_kvm_end_to_end_transfer_lowers_every_layers_error_and_the_state_stays_flat(tiny_folder, tmp_path):
    out = tmp_path / "out"
    options = kvm_options(tmp_path, SMALL_MLA_KVM + ",transfer_steps=25,transfer_lr=0.05", cache_ratio=0.5)
    model, _ = convert_pretrained(str(tiny_folder), options, out, progress=False)
    stored = json.loads((out / CONVERTED_MANIFEST).read_text())
    assert stored["method"] == "mla-kvm" and stored["kind"] == "mla-kvm" and stored["cache_ratio"] == 0.5
    layers = stored["refinement"]["layers"]
    assert len(layers) == 2 and all(layer["relative_error_after"] < layer["relative_error_before"] for layer in layers)
    table = stored["cache_bytes"]
    assert table[0]["bytes"] == model.cache_bytes(table[0]["context"]) and len({row["bytes"] for row in table}) == 1
    config = json.loads((out / "config.json").read_text())
    layer_options = config["per_layer_options"]
    assert all(o["min_rows"] == 6 and o["kv_rank"] + o["rope_dim"] == 24 for o in layer_options)  # half of 2 G d_h = 48
    reloaded = load_language_model(str(out))
    ids = torch.randint(3, 99, (1, 40))
    with torch.no_grad():
        assert torch.equal(reloaded.model(ids).logits, model(ids).logits)
    assert reloaded.identity["converted"]["method"] == "mla-kvm"


def test_streaming_keeps_the_original_weights_and_forgets_only_the_middle():
    """streaming with a window covering the sequence is the original; a short window changes late
    tokens only, and its cache stops growing at sinks + window - 1 tokens."""
    original = perturbed(tiny_model("llama"))
    source, layers = contexts(original)
    method = get_conversion("streaming")
    _, wide = parse_method("streaming:window=64")
    _, narrow = parse_method("streaming:window=8,sink_len=2")
    whole, _, _ = build_converted(source, method, layers, [wide] * len(layers))
    short, _, _ = build_converted(source, method, layers, [narrow] * len(layers))
    assert max_logit_error(original, whole) < 1e-4
    ids = torch.randint(3, 99, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full, cut = original(ids).logits, short(ids).logits
    assert torch.allclose(cut[:, :8], full[:, :8], atol=1e-4) and not torch.allclose(cut[:, 8:], full[:, 8:], atol=1e-3)
    assert short.cache_bytes(1000) == short.cache_bytes(20) == 2 * (2 + 7) * 2 * 2 * 12 * 4

"""The data pipeline on tiny texts in a temporary cache, plus the real (untokenized) Shakespeare split."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from slimkv.cli import main
from slimkv.common.files import sha256_file
from slimkv.data import load_dataset, prepare_text, shakespeare_plays, shakespeare_split
from slimkv.data.shakespeare import VAL_PLAYS, markdown_to_text
from slimkv.data.tokenizer import encode_long

WORDS = "the king doth wake tonight and sleep no more, good Horatio; café naïve — 王 🙂 thee thou hath".split()
TRICKY = ["", " leading space", "two  spaces\tand a tab", "line\nbreak\r\nwindows", "trailing  \n\n\n", "café 🙂 王", "'tis   ' s", "\n x"]


def write_corpus(folder, n_files=3, lines=120, seed=0):
    """Files of random lines (each with a marker naming its file), returned as paths."""
    rng = random.Random(seed)
    paths = []
    for f in range(n_files):
        text = "\n".join(f"file{f}-line{i} " + " ".join(rng.choices(WORDS, k=rng.randint(1, 12))) for i in range(lines)) + "\n"
        path = folder / f"doc{f}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("SLIMKV_CACHE", str(folder))
    return folder


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    return write_corpus(folder)


def test_prepare_writes_arrays_tokenizer_and_manifest(cache, corpus):
    folder = prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    assert folder == cache / "datasets" / "tiny"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"train.npy", "val.npy", "token_bytes.npy", "tokenizer.json", "val.txt"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(folder / name)
        assert entry["bytes"] == (folder / name).stat().st_size
    sources = {s["name"]: s for s in manifest["sources"]}
    for path in corpus:
        assert sources[str(path.resolve())]["file_sha256"] == sha256_file(path)
    assert manifest["split"]["val"] == [str(corpus[-1].resolve())]
    assert manifest["split"]["train"] == [str(p.resolve()) for p in corpus[:-1]]

    ds = load_dataset("tiny")
    assert ds.train.dtype == np.int64 and ds.val.dtype == np.int64 and ds.token_bytes.dtype == np.int64
    assert 256 < ds.vocab_size <= 300 and ds.token_bytes.shape == (ds.vocab_size,)
    assert ds.vocab_size == ds.tokenizer.get_vocab_size()
    assert max(ds.train.max(), ds.val.max()) < ds.vocab_size
    assert manifest["train"]["tokens"] == ds.train.size and manifest["val"]["tokens"] == ds.val.size
    assert manifest["train"]["bytes"] == sum(len(p.read_bytes()) for p in corpus[:-1]) + 2  # one "\n\n" separator


def test_roundtrip_and_byte_counts(cache, corpus):
    prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    ds = load_dataset("tiny")
    for text in TRICKY + [corpus[0].read_text()]:
        ids = ds.encode(text)
        assert ds.decode(ids) == text
        assert int(ds.token_bytes[np.asarray(ids, dtype=np.int64)].sum()) == len(text.encode("utf-8"))
    val_text = ds.val_text()
    assert ds.decode(ds.val) == val_text
    assert ds.encode(val_text) == ds.val.tolist()
    assert int(ds.token_bytes[ds.val].sum()) == len(val_text.encode("utf-8"))
    assert int(ds.token_bytes[ds.train].sum()) == ds.manifest["train"]["bytes"]
    assert ds.decode(ds.val.reshape(1, -1)) == val_text  # batched ids are flattened


def test_val_file_never_in_training(cache, corpus):
    prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    ds = load_dataset("tiny")
    train_text = ds.decode(ds.train)
    assert ds.val_text() == corpus[-1].read_text()
    assert train_text == "\n\n".join(p.read_text() for p in corpus[:-1])
    assert "file2-" not in train_text and "file0-" not in ds.val_text()


def test_single_file_splits_last_tenth_at_a_line_start(cache, tmp_path):
    path = write_corpus(tmp_path, n_files=1, lines=200)[0]
    text = path.read_text()
    prepare_text([path], name="one", vocab_size=300, progress=False)
    ds = load_dataset("one")
    val_text, cut = ds.val_text(), ds.manifest["split"]["cut_char"]
    assert text[cut:] == val_text and ds.decode(ds.train) == text[:cut]
    assert text[cut - 1] == "\n" and 0.08 < len(val_text) / len(text) <= 0.1


def test_second_call_reuses_and_changes_rebuild(cache, corpus):
    folder = prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    manifest_path = folder / "manifest.json"
    first = folder.stat().st_ino, manifest_path.stat().st_mtime_ns, manifest_path.read_text()
    prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    assert (folder.stat().st_ino, manifest_path.stat().st_mtime_ns, manifest_path.read_text()) == first

    corpus[-1].write_text(corpus[-1].read_text() + "a new line of val text\n", encoding="utf-8")
    prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    second = json.loads(manifest_path.read_text())
    assert second["build_key"] != json.loads(first[2])["build_key"]
    assert load_dataset("tiny").val_text().endswith("a new line of val text\n")

    prepare_text(corpus, name="tiny", vocab_size=280, progress=False)
    assert json.loads(manifest_path.read_text())["requested_vocab_size"] == 280

    before, inode = json.loads(manifest_path.read_text()), folder.stat().st_ino
    prepare_text(corpus, name="tiny", vocab_size=280, force=True, progress=False)
    after = json.loads(manifest_path.read_text())
    assert folder.stat().st_ino != inode and after["build_key"] == before["build_key"]  # a new folder
    assert after["files"] == before["files"]  # a forced rebuild of the same inputs is bit-identical
    assert not any((cache / "datasets" / ".building").iterdir())  # no leftovers


def test_damaged_file_is_detected_and_rebuilt(cache, corpus):
    folder = prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    good = sha256_file(folder / "val.npy")
    ids = np.load(folder / "val.npy")
    ids[0] = (int(ids[0]) + 1) % 256
    np.save(folder / "val.npy", ids)
    with pytest.raises(ValueError, match="val.npy.*slimkv data prepare --text"):
        load_dataset("tiny")
    prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    assert sha256_file(folder / "val.npy") == good


def test_missing_dataset_names_the_prepare_command(cache):
    with pytest.raises(FileNotFoundError, match="slimkv data prepare shakespeare"):
        load_dataset()
    with pytest.raises(FileNotFoundError, match="slimkv data prepare --text PATH .* --name mine"):
        load_dataset("mine")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"vocab_size": 70000}, "vocab_size"),
        ({"vocab_size": 300.0}, "vocab_size"),
        ({"name": "../up"}, "name"),
        ({"name": "shakespeare"}, "name 'shakespeare' is reserved"),
    ],
)
def test_bad_options_raise_before_work(cache, corpus, kwargs, match):
    options = {"name": "tiny", "vocab_size": 300, "progress": False, **kwargs}
    with pytest.raises(ValueError, match=match):
        prepare_text(corpus, **options)
    assert not (cache / "datasets" / "tiny").exists()


def test_bad_inputs(cache, corpus, tmp_path):
    with pytest.raises(ValueError, match="non-empty list"):
        prepare_text([], name="tiny", progress=False)
    with pytest.raises(ValueError, match="more than once"):
        prepare_text([corpus[0], corpus[0]], name="tiny", progress=False)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        prepare_text([tmp_path / "nope.txt"], name="tiny", progress=False)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1") * 50)
    with pytest.raises(ValueError, match="latin1.txt is not valid UTF-8"):
        prepare_text([latin1], name="tiny", progress=False)


def test_encode_long_matches_encoding_whole(cache, corpus):
    prepare_text(corpus, name="tiny", vocab_size=300, progress=False)
    tokenizer = load_dataset("tiny").tokenizer
    text = "\n".join(TRICKY * 20) + "\n".join(p.read_text() for p in corpus)
    expected = tokenizer.encode(text).ids
    for chunk_chars in (1, 7, 64, 10_000):
        assert encode_long(tokenizer, text, chunk_chars=chunk_chars) == expected


def test_cli_prepare_list_and_errors(cache, corpus, capsys):
    args = ["data", "prepare", "--text", *map(str, corpus), "--name", "tiny", "--vocab-size", "300", "--quiet"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip() == str(cache / "datasets" / "tiny")
    assert main(["data", "list"]) == 0
    assert "tiny" in capsys.readouterr().out
    assert main(["data", "prepare"]) == 2
    assert main(["data", "prepare", "--text", str(corpus[0])]) == 2
    assert "--name" in capsys.readouterr().err
    assert main(["data", "prepare", "shakespeare", "--vocab-size", "10"]) == 2
    assert "--vocab-size" in capsys.readouterr().err
    for command in (["data"], ["data", "prepare"], ["data", "list"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--help"])
        assert exit_info.value.code == 0
    assert "shakespeare" in capsys.readouterr().out


def test_markdown_to_text():
    markdown = (
        "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_Enter BERNARDO and\nFRANCISCO_\n\n"
        "**BERNARDO**  \nWho's there?  \nStand &amp; unfold.\n\n\n\n*Exit.*\n\n**HAMLET**  \n_\\[Aside]_  \n"
        "'Fair-ladies'\\--or so.  \n"
    )
    assert markdown_to_text(markdown) == (
        "Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nEnter BERNARDO and\nFRANCISCO\n\n"
        "BERNARDO\nWho's there?\nStand & unfold.\n\nExit.\n\nHAMLET\n[Aside]\n'Fair-ladies'--or so."
    )


def test_real_shakespeare_split():
    plays = shakespeare_plays()
    assert len(plays) == 38 and list(plays) == sorted(plays)
    train, val = shakespeare_split()
    assert shakespeare_split() == (train, val)
    assert sorted(val) == sorted(VAL_PLAYS) and not set(train) & set(val) and set(train) | set(val) == set(plays)
    val_share = sum(len(plays[n]) for n in val) / sum(len(t) for t in plays.values())
    assert 0.05 < val_share < 0.15
    assert plays["hamlet"].startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    for name, text in plays.items():
        assert not any(mark in text for mark in ("**", "_", "\\", "&amp;", "# ", "  \n")), name

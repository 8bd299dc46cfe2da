"""The Debian-packaged calibration texts and the --calib grammar, offline: tiny hand-built .deb
files, synthetic inputs for each parser, fake sources for the mixing."""

from __future__ import annotations

import io
import math
import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from slimkv.common.files import read_json, sha256_file
from slimkv.data import corpora, debian, texts
from slimkv.data.corpora import (
    CORPORA,
    Corpus,
    bible_books,
    devil_chunks,
    dictd_entries,
    dictd_number,
    handbook_documents,
    html_paragraphs,
    read_compressed_data_file,
    rst_to_text,
    split_documents,
    unlzw,
)
from slimkv.data.debian import deb_member, deb_members, download_deb, fetch_package_texts, package_files
from slimkv.data.texts import (
    DOC_SEPARATOR,
    MIXED_CALIBRATION,
    calibration_documents,
    calibration_ids,
    calibration_sources,
    check_calibration_size,
    evaluation_text,
)

# --- a tiny .deb --------------------------------------------------------------------------------


def ar_archive(members: list[tuple[str, bytes]]) -> bytes:
    """An ``ar`` archive as dpkg writes it (60-byte headers, bodies padded to even length)."""
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data + b"\n" * (len(data) % 2)
    return out


def tar_archive(files: dict[str, bytes], mode: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:
        folder = tarfile.TarInfo("./usr/")
        folder.type = tarfile.DIRTYPE
        archive.addfile(folder)
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def make_deb(path: Path, files: dict[str, bytes], data_name: str = "data.tar.xz") -> Path:
    control = tar_archive({"control": b"Package: tiny\n"}, "w:gz")
    data = tar_archive(files, "w:xz" if data_name.endswith(".xz") else "w:gz")
    path.write_bytes(ar_archive([("debian-binary", b"2.0\n"), ("control.tar.gz", control), (data_name, data)]))
    return path


FILES = {"usr/share/a/one.txt": b"one", "usr/share/a/two.txt": b"second file", "usr/share/b/three.dat": b"3"}


def test_deb_members_reads_files_by_predicate(tmp_path):
    deb = make_deb(tmp_path / "tiny_1.0_all.deb", FILES)
    assert deb_members(deb, lambda path: path.endswith(".txt")) == {"usr/share/a/one.txt": b"one", "usr/share/a/two.txt": b"second file"}
    assert deb_member(deb, "usr/share/b/three.dat") == b"3"
    assert deb_member(deb, "./usr/share/a/one.txt") == b"one"
    assert deb_members(deb, lambda path: path.startswith("usr/")) == FILES  # folders are not files
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        deb_member(deb, "usr/share/a/missing.txt")
    gz = make_deb(tmp_path / "gz.deb", FILES, data_name="data.tar.gz")
    assert deb_member(gz, "usr/share/a/two.txt") == b"second file"


def test_deb_reader_refuses_what_it_cannot_read(tmp_path):
    (tmp_path / "not.deb").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ValueError, match="not a Debian package"):
        deb_member(tmp_path / "not.deb", "x")
    (tmp_path / "empty.deb").write_bytes(ar_archive([("debian-binary", b"2.0\n")]))
    with pytest.raises(ValueError, match="no data archive"):
        deb_member(tmp_path / "empty.deb", "x")
    (tmp_path / "zst.deb").write_bytes(ar_archive([("debian-binary", b"2.0\n"), ("data.tar.zst", b"\x28\xb5\x2f\xfd")]))
    with pytest.raises(ValueError, match="zstd"):
        deb_member(tmp_path / "zst.deb", "x")


def test_download_deb_names_the_package_when_apt_get_is_missing_or_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(debian.shutil, "which", lambda name: None)
    with pytest.raises(FileNotFoundError, match="bible-kjv-text.*apt-get is not available"):
        download_deb("bible-kjv-text", tmp_path)
    monkeypatch.setattr(debian.shutil, "which", lambda name: "/usr/bin/apt-get")
    monkeypatch.setattr(debian.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=100, stderr="E: Unable to locate package dict-devil"))
    with pytest.raises(FileNotFoundError, match=r"apt-get download dict-devil.*Unable to locate.*apt-get update"):
        download_deb("dict-devil", tmp_path)


def test_fetch_package_texts_builds_once_with_a_manifest(tmp_path, monkeypatch):
    source = make_deb(tmp_path / "tiny_1.0_all.deb", FILES)
    downloads = []

    def fake_download(package: str, folder: Path) -> Path:
        downloads.append(package)
        return Path(shutil.copy(source, folder))

    def build(deb: Path) -> dict[str, bytes]:
        found = deb_members(deb, lambda path: path.endswith(".txt"))
        return {Path(path).name: data.upper() for path, data in found.items()}

    monkeypatch.setattr(debian, "download_deb", fake_download)
    folder = tmp_path / "cache" / "tiny"
    assert fetch_package_texts(folder, "tiny", build, "public domain") == folder
    manifest = read_json(folder / "manifest.json")
    assert manifest["package"] == "tiny" and manifest["license"] == "public domain" and manifest["deb_sha256"] == sha256_file(source)
    assert manifest["files"] == {"one.txt": sha256_file(folder / "one.txt"), "two.txt": sha256_file(folder / "two.txt")}
    assert [path.read_bytes() for path in package_files(folder)] == [b"ONE", b"SECOND FILE"]
    fetch_package_texts(folder, "tiny", lambda deb: pytest.fail("built twice"), "public domain")
    assert downloads == ["tiny"]

    bad = tmp_path / "cache" / "bad"
    with pytest.raises(ValueError, match="plain file names"):
        fetch_package_texts(bad, "tiny", lambda deb: {"a/b.txt": b"x"}, "none")
    assert not bad.exists() and not list(bad.parent.glob(".bad*"))


# --- kjv: LZW blocks of the Bible Retrieval System ---------------------------------------------


def lzw_compress(data: bytes, max_bits: int = 16, clear_at: int = 0) -> bytes:
    """Unix compress's block-mode LZW codes (no header): an independent encoder that writes codes
    in groups of 8 of one width, padding the group at a width change and after a CLEAR code,
    which it emits whenever the next free code reaches ``clear_at`` (0: never)."""
    table = {bytes([i]): i for i in range(256)}
    state = {"free": 257, "bits": 0, "total": 0, "n_bits": 9, "base": 0}

    def pad() -> None:
        group = state["n_bits"] * 8
        state["total"] = state["base"] = state["base"] + math.ceil((state["total"] - state["base"]) / group) * group

    def emit(code: int) -> None:
        state["bits"] |= code << state["total"]
        state["total"] += state["n_bits"]
        if code == 256:
            pad()
            state["n_bits"], state["free"] = 9, 257
            del_keys = [key for key, value in table.items() if value > 256]
            for key in del_keys:
                del table[key]
        elif state["free"] > (1 << state["n_bits"]) - 1 and state["n_bits"] < max_bits:
            pad()
            state["n_bits"] += 1

    word = b""
    for byte in data:
        longer = word + bytes([byte])
        if longer in table:
            word = longer
            continue
        emit(table[word])
        if state["free"] < 1 << max_bits:
            table[longer] = state["free"]
            state["free"] += 1
        if state["free"] == clear_at:
            emit(256)
        word = bytes([byte])
    if word:
        emit(table[word])
    return state["bits"].to_bytes((state["total"] + 7) // 8, "little")


def sample_text(n: int) -> bytes:
    rng = random.Random(1)
    words = [b"the", b"heaven", b"and", b"earth", b"light", b"darkness", b"waters", b"God", b"said", b"was"]
    return b" ".join(rng.choice(words) + bytes([rng.randrange(97, 123)]) for _ in range(n))[:n]


@pytest.mark.parametrize("size", [0, 1, 200, 5000, 60000])
@pytest.mark.parametrize("clear_at", [0, 700])
def test_unlzw_inverts_compress(size, clear_at):
    data = sample_text(size)
    codes = lzw_compress(data, clear_at=clear_at)
    assert unlzw(codes) == data
    if size >= 5000:  # long enough for the codes to widen (9 to 13 bits at 60000) and to compress
        assert len(codes) < size // 2


@pytest.mark.skipif(shutil.which("gzip") is None, reason="gzip, the external .Z decoder this test compares unlzw with, is not installed "
                    "(the round-trip and CLEAR-code tests beside it still check unlzw)")
def test_unlzw_agrees_with_gzip_on_the_same_stream():
    data = sample_text(60000)
    for clear_at in (0, 700, 3000):  # CLEAR codes at 10 and 12 bits, after width changes
        z = b"\x1f\x9d\x90" + lzw_compress(data, clear_at=clear_at)
        assert subprocess.run(["gzip", "-dc"], input=z, capture_output=True, check=True).stdout == data == unlzw(z[3:])
    cleared = pack_codes([(97, 9), (98, 9), (256, 9)], pad_to=72) + pack_codes([(99, 9)])
    assert unlzw(cleared) == b"abc" == subprocess.run(["gzip", "-dc"], input=b"\x1f\x9d\x90" + cleared, capture_output=True).stdout


def pack_codes(codes: list[tuple[int, int]], pad_to: int = 0) -> bytes:
    bits = total = 0
    for code, width in codes:
        bits |= code << total
        total += width
    total = max(total, pad_to)
    return bits.to_bytes((total + 7) // 8, "little")


def test_unlzw_clear_code_resets_the_table_after_a_padded_group():
    stream = pack_codes([(97, 9), (98, 9), (257, 9), (256, 9)], pad_to=72) + pack_codes([(99, 9), (257, 9)])
    assert unlzw(stream) == b"abab" + b"c" + b"cc"  # 257 = "ab" before the CLEAR, "cc" (KwKwK) after it
    with pytest.raises(ValueError, match="corrupt LZW"):
        unlzw(pack_codes([(97, 9), (300, 9)]))


def ec02_file(text: bytes, block_size: int) -> bytes:
    blocks = [lzw_compress(text[start : start + block_size]) for start in range(0, len(text), block_size)]
    head = b"EC02" + b"Compressed Data File".ljust(80, b"\0") + block_size.to_bytes(4, "big") + len(blocks).to_bytes(4, "big")
    start = len(head) + 4 * (len(blocks) + 1) + 3
    offsets = [start]
    for block in blocks:
        offsets.append(offsets[-1] + len(block))
    return head + b"".join(o.to_bytes(4, "big") for o in offsets) + b"\x1f\x9d\x90" + b"".join(blocks)


def test_compressed_data_file_decodes_block_by_block():
    text = sample_text(10000)
    data = ec02_file(text, 4096)
    assert read_compressed_data_file(data) == text
    with pytest.raises(ValueError, match="EC02"):
        read_compressed_data_file(b"XX02" + data[4:])
    with pytest.raises(ValueError, match="damaged"):
        read_compressed_data_file(data + b"\0")  # the last offset is no longer the file size
    short = ec02_file(text[:3000] + text[4096:], 4096)  # a first block shorter than the block size
    with pytest.raises(ValueError, match="block size"):
        read_compressed_data_file(short[:0x54] + (3000).to_bytes(4, "big") + short[0x58:])


def test_bible_books_strip_references_and_split_books_and_chapters():
    text = ("Holy Bible, Authorized (King James) Version.  Textfile 930105.\n"
            "Ge1:1 In the beginning.\nGe1:2 And the earth.\nGe2:1 Thus the heavens.\n"
            "1Sm1:1 Now there was a certain man.\n1Sm1:10 And she was in bitterness.\n")
    assert bible_books(text) == ["In the beginning.\nAnd the earth.\n\nThus the heavens.",
                                 "Now there was a certain man.\nAnd she was in bitterness."]


# --- devil: dictd ------------------------------------------------------------------------------


def test_dictd_numbers_and_entries():
    assert [dictd_number(t) for t in ("A", "b", "BA", "uA", "/", "BdqM")] == [0, 27, 64, 46 * 64, 63, ((1 * 64 + 29) * 64 + 42) * 64 + 12]
    entries = [b"ABASEMENT, n.  A decent _attitude_.\n\n", b"BABE, n.  A _misshapen\ncreature_.\n\n", b"ZEUS, n.  A god.\n"]
    data = b"00-database-short\n  The Devil\n" + b"".join(entries)
    offsets = [len(b"00-database-short\n  The Devil\n")]
    for entry in entries:
        offsets.append(offsets[-1] + len(entry))

    def code(n: int) -> str:
        digits = ""
        while True:
            digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"[n % 64] + digits
            n //= 64
            if not n:
                return digits

    index = "\n".join([f"00databaseshort\tA\t{code(offsets[0])}", f"zeus\t{code(offsets[2])}\t{code(len(entries[2]))}",
                       f"babe\t{code(offsets[1])}\t{code(len(entries[1]))}", f"baby\t{code(offsets[1])}\t{code(len(entries[1]))}",
                       f"abasement\t{code(offsets[0])}\t{code(len(entries[0]))}"]) + "\n"
    parsed = dictd_entries(data, index)
    assert parsed == ["ABASEMENT, n.  A decent _attitude_.", "BABE, n.  A _misshapen\ncreature_.", "ZEUS, n.  A god."]
    assert devil_chunks(parsed, size=2) == ["ABASEMENT, n.  A decent attitude.\n\nBABE, n.  A misshapen\ncreature.", "ZEUS, n.  A god."]
    assert devil_chunks(["snake_case stays, __init__ too"]) == ["snake_case stays, __init__ too"]


# --- pydoc: reST -------------------------------------------------------------------------------

RST = """\
:mod:`bisect` --- Array bisection algorithm
===========================================

.. module:: bisect
   :synopsis: Array bisection algorithms for binary searching.
.. sectionauthor:: Fred L. Drake, Jr. <fdrake@acm.org>

.. _bisect-example:

**Source code:** :source:`Lib/bisect.py`

.. function:: bisect_left(a, x, lo=0, hi=len(a), *, key=None)

   Locate the insertion point for *x* in *a*; see :func:`~bisect.insort` and
   :ref:`the recipes <bisect
   recipes>`, ``list.insert()`` and the `Python site <https://python.org>`_.

   .. versionchanged:: 3.10
      Added the *key* parameter.

Example::

   def f(*args, **kwargs):
       return 2 * 3 * 4
"""


def test_rst_to_text_keeps_prose_and_signatures_drops_markup():
    assert rst_to_text(RST) == """\
bisect --- Array bisection algorithm

Source code: Lib/bisect.py

bisect_left(a, x, lo=0, hi=len(a), *, key=None)

   Locate the insertion point for x in a; see insort and
   the recipes, list.insert() and the Python site.

      Added the key parameter.

Example:

   def f(*args, **kwargs):
       return 2 * 3 * 4"""


# --- handbook: HTML ----------------------------------------------------------------------------

PAGE = """<?xml version="1.0"?><html><head><title>6.2. APT</title></head><body><div id="banner"><a href="x">Download the ebook</a></div>
<ul class="docnav top"><li class="previous"><a href="p.html"><strong>Prev</strong></a></li></ul>
<div class="section"><h2 class="title"><a id="s"></a>6.2. The <code>apt</code>
   Command</h2><div class="para">
   APT is the <span class="emphasis"><em>Advanced</em></span> Packaging Tool; it &amp; dpkg work together.<br/>Second line.
   <div class="url">&#8594; <a href="https://example.org">https://example.org</a></div>
   </div><pre class="screen"><code>$ apt update</code></pre><ul><li><p>one item</p></li></ul>
<table><tr><td>an option table</td></tr></table></div><ul class="docnav"><li>Next</li></ul></body></html>"""


def test_html_paragraphs_keep_prose_and_drop_code_navigation_and_urls():
    assert html_paragraphs(PAGE) == ["6.2. The apt Command", "APT is the Advanced Packaging Tool; it & dpkg work together.", "Second line.",
                                     "one item"]


def test_the_handbook_is_its_pages_without_the_table_of_contents(monkeypatch, tmp_path):
    pages = []
    for i in range(12):
        path = tmp_path / f"page{i:02d}.html"
        path.write_text(f"<html><body><div class='para'>{f'word{i} ' * (300 if i != 3 else 10)}</div></body></html>", encoding="utf-8")
        pages.append(path)
    (tmp_path / "index.html").write_text("<html><body><div class='para'>" + "toc " * 400 + "</div></body></html>", encoding="utf-8")
    monkeypatch.setattr(corpora, "fetch_package_texts", lambda *args: tmp_path)
    monkeypatch.setattr(corpora, "package_files", lambda folder: [*pages, tmp_path / "index.html"])
    documents = handbook_documents()
    assert [doc.split()[0] for doc in documents] == [f"word{i}" for i in range(12) if i != 3]  # page 3 is too short


def test_every_source_holds_every_fifth_document_out():
    documents = [f"doc{i}" for i in range(12)]
    held = split_documents(documents, "val")
    assert held == ["doc1", "doc6", "doc11"]
    assert split_documents(documents, "train") == [d for d in documents if d not in held]
    assert split_documents(["only"], "val") == [] and split_documents(["only"], "train") == ["only"]
    with pytest.raises(ValueError, match="split 'test'"):
        split_documents(documents, "test")


def test_calibration_reads_the_train_split_and_evaluation_the_held_out_one(fake_sources):
    kjv = CORPORA["kjv"].documents()
    assert calibration_sources("kjv")[0][1] == [kjv[0], *kjv[2:]] and kjv[1] == "held 1"
    assert evaluation_text("kjv-val") == kjv[1]
    assert evaluation_text("kjv") == DOC_SEPARATOR.join(kjv)  # the whole text, when asked for by name
    for name in CORPORA:
        with pytest.raises(ValueError, match=f"names evaluation text {name}-val"):
            calibration_sources(f"shakespeare,{name}-val")


# --- the --calib grammar and the mixing --------------------------------------------------------


@pytest.fixture
def fake_sources(monkeypatch):
    """Every named source replaced by a few documents of numbered words (no downloads); a Debian
    source's calibration split is ``documents(...)``, with one held-out document ("held ...") in
    the places ``split_documents`` holds out."""
    def documents(base: int, count: int, words: int) -> list[str]:
        return [" ".join(str(base + 100 * d + w) for w in range(words)) for d in range(count)]

    def with_held_out(train: list[str]) -> list[str]:
        full, rest = [], list(train)
        while rest:
            full.append(f"held {len(full)}" if len(full) % 5 == 1 else rest.pop(0))
        return full

    monkeypatch.setattr(texts, "_shakespeare", lambda split: documents(1000 if split == "train" else 9000, 3, 40))
    monkeypatch.setitem(CORPORA, "kjv", Corpus(lambda: with_held_out(documents(2000, 4, 30)), "kjv", "pd"))
    monkeypatch.setitem(CORPORA, "devil", Corpus(lambda: with_held_out(documents(3000, 2, 50)), "devil", "pd"))
    monkeypatch.setitem(CORPORA, "pydoc", Corpus(lambda: with_held_out(documents(4000, 5, 8)), "pydoc", "psf"))
    monkeypatch.setitem(CORPORA, "handbook", Corpus(lambda: with_held_out(documents(5000, 3, 20)), "handbook", "gpl"))


class WordTokenizer:
    """Each whitespace-separated number is one token id."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[int(word) for word in text.split()])


def source_of(window: torch.Tensor) -> int:
    kinds = {int(token) // 1000 for token in window}
    assert len(kinds) == 1, "a window mixes sources"
    return kinds.pop()


def test_calibration_sources_parses_names_paths_and_mixes(fake_sources, tmp_path, monkeypatch):
    assert MIXED_CALIBRATION == "shakespeare,kjv,devil,pydoc,handbook"
    mixed = calibration_sources(MIXED_CALIBRATION)
    assert [name for name, _ in mixed] == ["shakespeare", "kjv", "devil", "pydoc", "handbook"]
    assert [len(docs) for _, docs in mixed] == [3, 4, 2, 5, 3]
    assert [name for name, _ in calibration_sources(" devil , kjv")] == ["devil", "kjv"]
    assert calibration_documents("kjv,devil") == CORPORA["kjv"].split("train") + CORPORA["devil"].split("train")
    assert calibration_documents("shakespeare") == texts._shakespeare("train")

    odd = tmp_path / "a,b.txt"
    odd.write_text("local text, with a comma in its name")
    assert calibration_sources(str(odd)) == [(str(odd), ["local text, with a comma in its name"])]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kjv").write_text("a file named like a source")
    assert calibration_sources("kjv")[0][1] == CORPORA["kjv"].split("train")
    assert calibration_sources("./kjv")[0][1] == ["a file named like a source"]


@pytest.mark.parametrize("spec, match", [
    ("austen", "evaluation text austen"),
    ("shakespeare-val", "evaluation text shakespeare-val"),
    ("shakespeare,austen", "evaluation text austen"),
    ("kvj", r"--calib 'kvj'.*did you mean kjv.*allowed values: shakespeare, kjv, devil, pydoc, handbook"),
    ("shakespeare,devill", r"'devill' is not a calibration source \(did you mean devil"),
    ("shakespeare,", r"'' is not a calibration source.*allowed values"),
    ("kjv,devil,kjv", "names kjv more than once"),
])
def test_calibration_spec_errors(fake_sources, spec, match):
    with pytest.raises(ValueError, match=match):
        calibration_sources(spec)


def test_a_missing_path_is_a_missing_file(fake_sources, tmp_path):
    with pytest.raises(FileNotFoundError, match="calib.txt.*neither a known source"):
        calibration_sources(str(tmp_path / "calib.txt"))


def test_mixed_windows_take_equal_shares_round_robin(fake_sources):
    sources = calibration_sources("shakespeare,kjv,devil")
    ids = calibration_ids(WordTokenizer(), sources, tokens=8 * 16, seq_len=16, seed=3)
    assert ids.shape == (8, 16)
    assert [source_of(row) for row in ids] == [1, 2, 3, 1, 2, 3, 1, 2]
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 16)) for row in ids)  # contiguous spans of one document
    assert torch.equal(ids, calibration_ids(WordTokenizer(), sources, 8 * 16, 16, seed=3))
    assert not torch.equal(ids, calibration_ids(WordTokenizer(), sources, 8 * 16, 16, seed=4))


def old_calibration_ids(tokenizer, documents, tokens, seq_len, seed):
    """The single-source sampler before mixing existed, verbatim in behaviour."""
    rng = random.Random(seed)
    cache, windows = {}, []
    for _ in range(math.ceil(tokens / seq_len)):
        for _attempt in range(100):
            index = rng.randrange(len(documents))
            if index not in cache:
                cache[index] = list(tokenizer(documents[index]).input_ids)
            ids = cache[index]
            if len(ids) >= seq_len:
                start = rng.randrange(len(ids) - seq_len + 1)
                windows.append(ids[start:start + seq_len])
                break
    return torch.tensor(windows, dtype=torch.long)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_one_source_gives_the_old_windows_either_way(fake_sources, seed):
    documents = calibration_documents("kjv") + ["1 2 3"]  # a short document the sampler must skip
    old = old_calibration_ids(WordTokenizer(), documents, 100, 20, seed)
    assert torch.equal(calibration_ids(WordTokenizer(), documents, 100, 20, seed), old)
    assert torch.equal(calibration_ids(WordTokenizer(), [("kjv", documents)], 100, 20, seed), old)


def test_a_source_too_short_for_the_window_is_named(fake_sources):
    with pytest.raises(ValueError, match="calibration source 'pydoc' has no document of at least 16 tokens"):
        calibration_ids(WordTokenizer(), calibration_sources("kjv,pydoc"), 64, 16)
    with pytest.raises(ValueError, match="calibration text has no document of at least 64 tokens"):
        calibration_ids(WordTokenizer(), calibration_documents("kjv"), 64, 64)
    with pytest.raises(ValueError, match="source 'devil' has no documents"):
        calibration_ids(WordTokenizer(), [("kjv", ["1 2 3"]), ("devil", [])], 64, 2)


def test_calibration_tokens_beyond_the_text_are_refused_not_resampled(fake_sources):
    sources = calibration_sources("shakespeare,devil")  # 3 x 40 and 2 x 50 tokens
    assert calibration_ids(WordTokenizer(), sources, 13 * 16, 16).shape == (13, 16)  # 7 and 6 windows: 112 of 120 and 96 of 100 tokens
    with pytest.raises(ValueError, match=r"--calib-tokens 224 in windows of --calib-seq-len 16 takes 112 tokens from calibration source 'devil' "
                                         r"\(its share, 7 of the 14 windows\), which holds only 100 tokens"):
        calibration_ids(WordTokenizer(), sources, 14 * 16, 16)
    with pytest.raises(ValueError, match="which holds only 120 tokens in documents of at least 16 tokens"):
        check_calibration_size(WordTokenizer(), calibration_documents("kjv"), 121, 16)
    check_calibration_size(WordTokenizer(), calibration_documents("kjv"), 120, 30)
    with pytest.raises(ValueError, match="--heal-text 'austen' names evaluation text austen"):
        calibration_sources("austen", option="--heal-text")


def test_evaluation_text_takes_the_new_sources(fake_sources, monkeypatch):
    assert evaluation_text("devil") == DOC_SEPARATOR.join(CORPORA["devil"].documents())
    assert evaluation_text("handbook-val") == "held 1"
    with pytest.raises(ValueError, match="names evaluation text handbook-val"):
        calibration_sources("kjv,handbook-val")
    with pytest.raises(ValueError, match="calibration split"):
        evaluation_text("shakespeare")


def test_the_registry_describes_every_source():
    assert list(CORPORA) == ["kjv", "devil", "pydoc", "handbook"]
    assert all(corpus.description and corpus.license for corpus in CORPORA.values())
    assert "not public domain" in CORPORA["pydoc"].description and "PSF" in CORPORA["pydoc"].license
    assert "not public domain" in CORPORA["handbook"].description and "CC-BY-SA" in CORPORA["handbook"].license


def test_a_mix_with_more_sources_than_windows_is_refused_naming_the_tokens_it_needs(fake_sources):
    """Each source of a mix gets a share of the windows; with fewer windows than sources one would get none."""
    with pytest.raises(ValueError, match=r"gives 4 windows, fewer than the 5 sources of the mix .*at least 80"):
        check_calibration_size(WordTokenizer(), calibration_sources("shakespeare,kjv,devil,pydoc,handbook"), 64, 16)


def test_a_package_folder_is_parsed_once_until_it_changes(tmp_path):
    from slimkv.data.corpora import MANIFEST, parsed_once
    calls = []
    parse = lambda folder: calls.append(folder) or ["a", "b"]  # noqa: E731
    bare = tmp_path / "bare"
    bare.mkdir()
    assert parsed_once(bare, parse) == parsed_once(bare, parse) == ["a", "b"] and len(calls) == 2  # no manifest: parsed each time
    folder = tmp_path / "package"
    folder.mkdir()
    (folder / MANIFEST).write_text("{}", encoding="utf-8")
    first = parsed_once(folder, parse)
    first.append("changed by a caller")
    assert parsed_once(folder, parse) == ["a", "b"] and len(calls) == 3  # parsed once; each call gets its own list
    os.utime(folder / MANIFEST, ns=(1, 1))  # the folder rebuilt
    parsed_once(folder, parse)
    assert len(calls) == 4

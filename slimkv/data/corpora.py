"""Calibration texts beyond Shakespeare, freely redistributable and installed from Debian packages.

Each source downloads its package once (``slimkv.data.debian``), keeps the package's text files
under ``cache_dir()/texts/<name>/`` and turns them into plain-text documents on every read (so a
better parser needs no re-download). ``CORPORA`` maps a source name to its documents function,
a one-line description and a license note; ``slimkv.data.texts`` offers them to ``--calib`` (mixed
with ``shakespeare``) and to ``--text``.

* ``kjv``: the King James Bible (``bible-kjv-text``, 2.4 MB .deb): 66 books, 4.1 M characters.
  The package stores the text LZW-compressed in 64 KB blocks (Unix ``compress``), decoded here.
* ``devil``: Ambrose Bierce's The Devil's Dictionary (``dict-devil``, 0.18 MB .deb, dictd format):
  999 entries in 20 documents, 0.38 M characters.
* ``pydoc``: the Python 3.11 documentation's reST sources (``python3.11-doc``, 12.6 MB .deb;
  497 files, 11 MB of reST): 408 documents of at least 2,000 characters, 9.6 M characters.
  PSF license: redistributable, not public domain.
* ``handbook``: The Debian Administrator's Handbook (``debian-handbook``, 34.8 MB .deb; its
  English HTML, 127 pages): modern English prose (2010s-2020s, technical), one document per page
  with its paragraphs, headings and list items (code listings, navigation and URLs dropped).

Every source is split by document (``split_documents``): every ``HELD_OUT_EVERY``-th document,
starting with the second, is held out (``NAME-val``: evaluation text that no calibration or healing
mix ever reads); calibration reads the others.
"""

from __future__ import annotations

import gzip
import re
import struct
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import NamedTuple

from slimkv.common.paths import cache_dir
from slimkv.data.debian import MANIFEST, deb_member, deb_members, fetch_package_texts, package_files

Z_MAGIC = b"\x1f\x9d"
LZW_CLEAR = 256


def _source_dir(name: str) -> Path:
    return cache_dir() / "texts" / name


# --- kjv: bible-kjv-text ---------------------------------------------------------------------

KJV_PACKAGE = "bible-kjv-text"
KJV_MEMBER = "usr/lib/bible.data"
KJV_LICENSE = "KJV text (1611) public domain (Crown patent in the UK only); package GPL-2+ (Chip Chapin, Matthew Vernon)"
KJV_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def unlzw(data: bytes, max_bits: int = 16) -> bytes:
    """Decode one block-mode LZW stream of Unix ``compress`` (the codes after a .Z header).

    Codes are packed least-significant bit first, 9 bits wide at first and one bit wider each
    time the table fills, up to ``max_bits``. The encoder writes codes in groups of 8 of one width
    and pads the group at a CLEAR code, which the reader skips (at a width change the group is
    always full: 256 codes of 9 bits, 512 of 10, ... since the start or the last CLEAR).
    """
    table = [bytes([i]) for i in range(256)] + [b""]
    out = bytearray()
    n_bits, pos, base, free, previous = 9, 0, 0, LZW_CLEAR + 1, b""
    end = len(data) * 8
    while pos + n_bits <= end:
        byte = pos >> 3
        code = (int.from_bytes(data[byte : byte + 3], "little") >> (pos & 7)) & ((1 << n_bits) - 1)
        pos += n_bits
        if code == LZW_CLEAR:
            group = n_bits * 8
            pos = base = base + -(-(pos - base) // group) * group
            del table[LZW_CLEAR + 1 :]
            n_bits, free, previous = 9, LZW_CLEAR + 1, b""
            continue
        if code < free:
            entry = table[code]
        elif code == free and previous:
            entry = previous + previous[:1]
        else:
            raise ValueError(f"corrupt LZW stream: code {code} at bit {pos - n_bits}, next free code {free}")
        out += entry
        if previous and free < 1 << max_bits:
            table.append(previous + entry[:1])
            free += 1
        previous = entry
        if free > (1 << n_bits) - 1 and n_bits < max_bits:
            n_bits, base = n_bits + 1, pos
    return bytes(out)


def read_compressed_data_file(data: bytes) -> bytes:
    """The text of the Bible Retrieval System's ``EC02`` file: an 80-byte title, block size and
    block count (big-endian u32 at 0x54, 0x58), block count + 1 offsets (the last is the file
    size), one .Z header, then every block LZW-coded separately (random access by block)."""
    if not data.startswith(b"EC02"):
        raise ValueError("not a Bible Retrieval System compressed data file (no EC02 magic)")
    block_size, count = struct.unpack(">II", data[0x54:0x5C])
    offsets = struct.unpack(f">{count + 1}I", data[0x5C : 0x5C + 4 * (count + 1)])
    header = data[offsets[0] - 3 : offsets[0]]
    if header[:2] != Z_MAGIC or offsets[-1] != len(data):
        raise ValueError("damaged EC02 file (block table does not match the data)")
    blocks = [unlzw(data[start:stop], header[2] & 0x1F) for start, stop in zip(offsets, offsets[1:])]
    if any(len(block) != block_size for block in blocks[:-1]):
        raise ValueError("damaged EC02 file (a block does not decode to the block size)")
    return b"".join(blocks)


def _build_kjv(deb: Path) -> dict[str, bytes]:
    return {"bible.txt": read_compressed_data_file(deb_member(deb, KJV_MEMBER))}


def bible_books(text: str) -> list[str]:
    """One document per book from ``Ge1:1 In the beginning ...`` lines: verse references
    stripped, one verse per line, a blank line between chapters. Lines that are not verses (the
    title line) are dropped."""
    books: dict[str, list[str]] = {}
    last_chapter: dict[str, str] = {}
    for line in text.splitlines():
        match = KJV_VERSE.match(line)
        if match is None:
            continue
        book, chapter, _verse, words = match.groups()
        lines = books.setdefault(book, [])
        if lines and last_chapter[book] != chapter:
            lines.append("")
        last_chapter[book] = chapter
        lines.append(words.strip())
    return ["\n".join(lines) for lines in books.values()]


_PARSED: dict[tuple[str, int], tuple[str, ...]] = {}  # (package folder, its manifest's mtime) -> documents: ``parsed_once``


def parsed_once(folder: Path, parse: Callable[[Path], list[str]]) -> list[str]:
    """``parse(folder)``: the documents of a package folder, parsed once per process while the folder
    stays as it is (keyed by its path and its manifest's modification time; a rebuilt folder is parsed
    again). A conversion reads its calibration sources several times (checks, calibration, head
    roles); the reST and HTML parsing took seconds each time. Each call returns a new list; a folder
    without a manifest (not one ``fetch_package_texts`` made) is parsed every time."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return list(parse(folder))
    key = (str(folder.resolve()), manifest.stat().st_mtime_ns)
    if key not in _PARSED:
        _PARSED[key] = tuple(parse(folder))
    return list(_PARSED[key])


def kjv_documents() -> list[str]:
    """The King James Bible, one document per book (66)."""
    folder = fetch_package_texts(_source_dir("kjv"), KJV_PACKAGE, _build_kjv, KJV_LICENSE)
    return parsed_once(folder, lambda f: bible_books(package_files(f)[0].read_text(encoding="utf-8")))


# --- devil: dict-devil -----------------------------------------------------------------------

DEVIL_PACKAGE = "dict-devil"
DEVIL_DICT = "usr/share/dictd/devil.dict.dz"
DEVIL_INDEX = "usr/share/dictd/devil.index"
DEVIL_LICENSE = "public domain (Ambrose Bierce, 1911; copyright expired); Debian packaging by Robert D. Hilliard, Sven Joachim"
DICTD_BASE64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
ENTRIES_PER_DOCUMENT = 50
EMPHASIS = re.compile(r"(?<![\w_])_([^_\n]+(?:\n[^_\n]+)*)_(?![\w_])")


def _build_devil(deb: Path) -> dict[str, bytes]:
    members = deb_members(deb, lambda path: path in (DEVIL_DICT, DEVIL_INDEX))
    if set(members) != {DEVIL_DICT, DEVIL_INDEX}:
        raise FileNotFoundError(f"{deb} lacks {DEVIL_DICT} or {DEVIL_INDEX}")
    return {"devil.dict": gzip.decompress(members[DEVIL_DICT]), "devil.index": members[DEVIL_INDEX]}


def dictd_number(text: str) -> int:
    """A dictd index number (base 64, most significant digit first, ``A`` = 0)."""
    value = 0
    for char in text:
        value = value * 64 + DICTD_BASE64.index(char)
    return value


def dictd_entries(data: bytes, index: str) -> list[str]:
    """The entries of a dictd dictionary in file order, each once (several headwords may share
    one entry), without the ``00database...`` metadata entries."""
    spans = set()
    for line in index.splitlines():
        if not line.strip():
            continue
        headword, offset, length = line.split("\t")[:3]
        if not headword.startswith("00database"):
            spans.add((dictd_number(offset), dictd_number(length)))
    return [data[start : start + length].decode("utf-8").strip() for start, length in sorted(spans)]


def devil_chunks(entries: list[str], size: int = ENTRIES_PER_DOCUMENT) -> list[str]:
    """Documents of ``size`` consecutive entries, ``_emphasis_`` marks dropped."""
    plain = [EMPHASIS.sub(r"\1", entry) for entry in entries]
    return ["\n\n".join(plain[start : start + size]) for start in range(0, len(plain), size)]


def devil_documents() -> list[str]:
    """The Devil's Dictionary, in chunks of 50 entries (A to Z)."""
    folder = fetch_package_texts(_source_dir("devil"), DEVIL_PACKAGE, _build_devil, DEVIL_LICENSE)
    return parsed_once(folder, lambda f: devil_chunks(dictd_entries((f / "devil.dict").read_bytes(), (f / "devil.index").read_text(encoding="utf-8"))))


# --- pydoc: python3.11-doc -------------------------------------------------------------------

PYDOC_PACKAGE = "python3.11-doc"
PYDOC_SOURCES = "usr/share/doc/python3.11/html/_sources/"
PYDOC_LEGAL = ("license.rst.txt", "copyright.rst.txt")  # legal boilerplate, not documentation prose
PYDOC_LICENSE = "PSF License Agreement (Python Software Foundation), code examples also 0BSD: redistributable, not public domain"
PYDOC_MIN_CHARS = 2000
RST_ADORNMENT = re.compile(r"^\s*([=\-~^\"'`#*+_.:<>])\1{2,}\s*$")
RST_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:[\w-]+:)?([\w-]+)::\s*(.*)$")
RST_EXPLICIT = re.compile(r"^\s*\.\.(\s|$)")
RST_FIELD = re.compile(r"^\s*:[\w -]+:(\s|$)")
# inline markup may wrap onto the next line, never across a blank line
RST_ROLE = re.compile(r":(?:[\w-]+:)*[\w-]+:`((?:[^`\n]|\n(?!\s*\n))*)`")
RST_LITERAL = re.compile(r"``((?:[^`\n]|\n(?!\s*\n))+)``")
RST_LINK = re.compile(r"`((?:[^`<\n]|\n(?!\s*\n))*?)\s*(?:<[^`>]*>)?`__?")
RST_STRONG = re.compile(r"\*\*([^\s*](?:[^*]*[^\s*])?)\*\*")
RST_EMPHASIS = re.compile(r"(?<![\w*\\])\*([^\s*][^*]*?)(?<!\s)\*(?![\w*])")
# object descriptions whose argument is text worth keeping (a signature); other directives
# (module, index, toctree, versionadded, highlight, ...) carry only metadata on their line
RST_SIGNATURES = frozenset({"function", "method", "class", "attribute", "data", "exception", "decorator",
                            "decoratormethod", "classmethod", "staticmethod", "abstractmethod", "describe", "cmdoption",
                            "option", "envvar", "opcode", "pdbcommand", "macro", "type", "member", "var", "coroutinefunction",
                            "coroutinemethod", "property"})


def _build_pydoc(deb: Path) -> dict[str, bytes]:
    sources = deb_members(deb, lambda path: path.startswith(PYDOC_SOURCES) and path.endswith(".txt"))
    files = {}
    for path, data in sources.items():
        relative = path.removeprefix(PYDOC_SOURCES)
        if relative not in PYDOC_LEGAL:
            files[relative.replace("/", "__")] = data
    if not files:
        raise FileNotFoundError(f"{deb} holds no reST sources under {PYDOC_SOURCES}")
    return dict(sorted(files.items()))


def _role_text(match: re.Match) -> str:
    """What Sphinx shows for a role: the title of ``title <target>``, the last part of ``~a.b``."""
    text = re.sub(r"\s*<[^>]*>$", "", match.group(1)).lstrip("!").strip()
    return text[1:].rsplit(".", 1)[-1] if text.startswith("~") else text


def rst_to_text(source: str) -> str:
    """reST (Sphinx) source as plain text: section adornments, comments, targets, field and
    option lines and metadata directives dropped; object signatures kept; inline markup (roles,
    literals, links, emphasis) reduced to its text; indentation (code blocks) kept."""
    lines = []
    for line in source.splitlines():
        directive = RST_DIRECTIVE.match(line)
        if directive is not None:
            indent, name, argument = directive.groups()
            if name in RST_SIGNATURES and argument:
                lines.append(indent + argument)
            continue
        if RST_ADORNMENT.match(line) or RST_EXPLICIT.match(line) or RST_FIELD.match(line) or line.strip() == "::":
            continue
        line = re.sub(r"(\S)::$", r"\1:", line)
        lines.append(RST_EMPHASIS.sub(r"\1", RST_STRONG.sub(r"\1", line)).rstrip())
    text = RST_LINK.sub(r"\1", RST_LITERAL.sub(r"\1", RST_ROLE.sub(_role_text, "\n".join(lines))))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def pydoc_documents() -> list[str]:
    """The Python 3.11 documentation, one document per reST file, files under 2,000 characters
    (once plain) dropped."""
    folder = fetch_package_texts(_source_dir("pydoc"), PYDOC_PACKAGE, _build_pydoc, PYDOC_LICENSE)
    return parsed_once(folder, lambda f: [text for text in (rst_to_text(path.read_text(encoding="utf-8")) for path in package_files(f))
                                          if len(text) >= PYDOC_MIN_CHARS])


# --- handbook: debian-handbook (HTML) --------------------------------------------------------

HANDBOOK_PACKAGE = "debian-handbook"
HANDBOOK_PAGES = "usr/share/doc/debian-handbook/html/en-US/"
HANDBOOK_LICENSE = "GPL-2+ or CC-BY-SA-3.0 (Raphael Hertzog, Roland Mas): redistributable, not public domain"
HANDBOOK_MIN_CHARS = 1000
HTML_SKIPPED = frozenset({"pre", "script", "style", "head", "table"})  # code listings, metadata, tables of options
HTML_SKIPPED_CLASSES = frozenset({"docnav", "toc", "url", "banner", "title-page", "legalnotice", "index"})
HTML_BLOCKS = frozenset({"p", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "br"})


def _build_handbook(deb: Path) -> dict[str, bytes]:
    pages = deb_members(deb, lambda path: path.startswith(HANDBOOK_PAGES) and path.endswith(".html") and "/" not in path[len(HANDBOOK_PAGES):])
    if not pages:
        raise FileNotFoundError(f"{deb} holds no HTML pages under {HANDBOOK_PAGES}")
    return {path.removeprefix(HANDBOOK_PAGES): data for path, data in sorted(pages.items())}


class _ProseParser(HTMLParser):
    """Paragraph text of an (X)HTML page: a paragraph ends at every block element (``HTML_BLOCKS``
    and ``div class="para"``); elements of ``HTML_SKIPPED`` or with a class in
    ``HTML_SKIPPED_CLASSES`` are dropped with everything inside them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._words: list[str] = []
        self._open: list[bool] = []  # per open element: whether it starts a skipped region
        self._skipping = 0

    def _flush(self) -> None:
        text = " ".join("".join(self._words).split())
        if text:
            self.paragraphs.append(text)
        self._words = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = set((dict(attrs).get("class") or "").split()) | {dict(attrs).get("id") or ""}
        skipped = tag in HTML_SKIPPED or bool(classes & HTML_SKIPPED_CLASSES)
        if tag in HTML_BLOCKS or "para" in classes or skipped:
            self._flush()
        if tag in ("br", "img", "meta", "link", "hr", "input"):  # void elements never close
            return
        self._open.append(skipped)
        self._skipping += skipped

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in HTML_BLOCKS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in HTML_BLOCKS or tag == "div":
            self._flush()
        if self._open and tag not in ("br", "img", "meta", "link", "hr", "input"):
            self._skipping -= self._open.pop()

    def handle_data(self, data: str) -> None:
        if not self._skipping:
            self._words.append(data)


def html_paragraphs(page: str) -> list[str]:
    """The paragraphs of an HTML page as single-spaced lines (``_ProseParser``)."""
    parser = _ProseParser()
    parser.feed(page)
    parser.close()
    parser._flush()
    return parser.paragraphs


def handbook_documents() -> list[str]:
    """The Debian Administrator's Handbook, one document per page of at least HANDBOOK_MIN_CHARS
    characters, pages sorted by file name (the table of contents, ``index.html``, left out)."""
    folder = fetch_package_texts(_source_dir("handbook"), HANDBOOK_PACKAGE, _build_handbook, HANDBOOK_LICENSE)
    return parsed_once(folder, lambda f: [text for text in ("\n".join(html_paragraphs(path.read_text(encoding="utf-8")))
                                                             for path in package_files(f) if path.name != "index.html")
                                          if len(text) >= HANDBOOK_MIN_CHARS])


# --- held-out splits ---------------------------------------------------------------------------

HELD_OUT_EVERY = 5  # every 5th document of a source is evaluation text only (``NAME-val``)
SPLITS = ("train", "val")


def split_documents(documents: list[str], split: str) -> list[str]:
    """``split`` "val": every HELD_OUT_EVERY-th document starting with the second (index 1, 6, 11,
    ...; a source of one document has none); "train": the others, in order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    return [doc for i, doc in enumerate(documents) if (i % HELD_OUT_EVERY == 1) == (split == "val")]


class Corpus(NamedTuple):
    """A source: every document (``documents``), a description, its license. ``split`` gives the
    calibration part ("train") or the held-out part ("val", ``split_documents``)."""

    documents: Callable[[], list[str]]
    description: str
    license: str

    def split(self, split: str) -> list[str]:
        return split_documents(self.documents(), split)


CORPORA: dict[str, Corpus] = {
    "kjv": Corpus(kjv_documents, "King James Bible (1611), one document per book (Debian bible-kjv-text)", KJV_LICENSE),
    "devil": Corpus(devil_documents, "Ambrose Bierce, The Devil's Dictionary (1911), 50 entries per document (Debian dict-devil)",
                    DEVIL_LICENSE),
    "pydoc": Corpus(pydoc_documents, "Python 3.11 documentation (reST sources as text, PSF license, not public domain; "
                    "Debian python3.11-doc)", PYDOC_LICENSE),
    "handbook": Corpus(handbook_documents, "The Debian Administrator's Handbook (modern English prose, GPL-2+/CC-BY-SA-3.0, not public domain; "
                       "Debian debian-handbook)", HANDBOOK_LICENSE),
}

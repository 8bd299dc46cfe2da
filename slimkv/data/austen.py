"""Jane Austen's six novels (1811-1817, public domain), the out-of-domain evaluation text: another
author, era and genre than the Shakespeare plays slimkv calibrates and trains on.

They install from Debian's ``r-cran-janeaustenr`` package (MIT, 1.6 MB), a registry this machine
kind reaches: ``fetch_austen`` downloads it with ``apt-get download`` (no R, no dpkg needed: see
``slimkv.data.debian``), reads the package's R lazy-load database ``data/Rdata.rdb`` (a concatenation of
[4-byte big-endian length][zlib stream of an XDR-serialised character vector], one element per line
of the Project Gutenberg text) and writes one ``.txt`` per novel with a manifest of hashes under
``cache_dir()/texts/austen/``. The novels are surely in the pretraining data of public models:
"out of domain" means out of slimkv's calibration and training domain.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from slimkv.common.paths import cache_dir
from slimkv.data.debian import deb_member, fetch_package_texts, package_files

PACKAGE = "r-cran-janeaustenr"
RDB_MEMBER = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
LICENSE = "texts public domain (Project Gutenberg); package MIT (Julia Silge)"


def austen_dir() -> Path:
    return cache_dir() / "texts" / "austen"


def read_character_vector(buf: bytes) -> list[str]:
    """The lines of an XDR-serialised R character vector (STRSXP of CHARSXP; NA -> "")."""
    if buf[:2] != b"X\n":
        raise ValueError("not an XDR-serialised R object")
    pos = 2
    (version,) = struct.unpack(">i", buf[pos : pos + 4])
    pos += 12  # format version, writer's R version, minimal R version
    if version == 3:
        (encoding_length,) = struct.unpack(">i", buf[pos : pos + 4])
        pos += 4 + encoding_length
    (flags,) = struct.unpack(">i", buf[pos : pos + 4])
    pos += 4
    if flags & 0xFF != 16:
        raise ValueError(f"not a character vector (R type {flags & 0xFF})")
    (count,) = struct.unpack(">i", buf[pos : pos + 4])
    pos += 4
    lines = []
    for _ in range(count):
        _, length = struct.unpack(">ii", buf[pos : pos + 8])
        pos += 8
        if length < 0:
            lines.append("")
            continue
        lines.append(buf[pos : pos + length].decode("utf-8", errors="replace"))
        pos += length
    return lines


def read_lazy_load_database(data: bytes) -> list[list[str]]:
    """Every character vector of an R lazy-load database, in file order."""
    pos, vectors = 0, []
    while pos < len(data):
        stream = zlib.decompressobj()
        raw = stream.decompress(data[pos + 4 :])
        pos += 4 + (len(data) - pos - 4 - len(stream.unused_data))
        vectors.append(read_character_vector(raw))
    return vectors


def _build(deb: Path) -> dict[str, bytes]:
    """One ``.txt`` per novel, named after its index and title, from the package's R database."""
    files = {}
    for index, lines in enumerate(read_lazy_load_database(deb_member(deb, RDB_MEMBER))):
        title = next((line for line in lines if line.strip()), "untitled").strip()
        name = f"{index}_" + "".join(c if c.isalnum() else "_" for c in title)[:40] + ".txt"
        files[name] = "\n".join(lines).encode("utf-8")
    return files


def fetch_austen() -> Path:
    """The folder of the six novels (downloaded and extracted once)."""
    return fetch_package_texts(austen_dir(), PACKAGE, _build, LICENSE)


def austen_documents() -> list[str]:
    """The six novels, in the package's order (Sense and Sensibility last, Emma first)."""
    files = sorted(package_files(fetch_austen()), key=lambda path: int(path.name.split("_", 1)[0]))
    return [path.read_text(encoding="utf-8") for path in files]

"""Jane Austen's six novels (1811-1817, public domain), the out-of-domain evaluation text: another
author, era and genre than the Shakespeare plays slimkv calibrates and trains on.

They install from Debian's ``r-cran-janeaustenr`` package (MIT, 1.6 MB), a registry this machine
kind reaches: ``fetch_austen`` downloads it with ``apt-get download`` (no R, no dpkg needed), reads
the package's R lazy-load database ``data/Rdata.rdb`` (a concatenation of
[4-byte big-endian length][zlib stream of an XDR-serialised character vector], one element per line
of the Project Gutenberg text) and writes one ``.txt`` per novel with a manifest of hashes under
``cache_dir()/texts/austen/``. The novels are surely in the pretraining data of public models:
"out of domain" means out of slimkv's calibration and training domain.
"""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import tarfile
import tempfile
import zlib
from pathlib import Path

from slimkv.common.files import atomic_directory, read_json, sha256_file, write_json
from slimkv.common.paths import cache_dir

PACKAGE = "r-cran-janeaustenr"
RDB_MEMBER = "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
MANIFEST = "manifest.json"


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


def deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb (an ar archive holding data.tar.*), read without dpkg."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise ValueError(f"{deb} is not a Debian package")
    pos = 8
    while pos + 60 <= len(data):
        name, size = data[pos : pos + 16].decode().strip().rstrip("/"), int(data[pos + 48 : pos + 58].decode().strip())
        body = data[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                for candidate in (member, "./" + member):
                    try:
                        return archive.extractfile(candidate).read()
                    except KeyError:
                        continue
            raise FileNotFoundError(f"{member} is not in {deb}")
        pos += 60 + size + (size % 2)
    raise ValueError(f"{deb} has no data archive")


def fetch_austen() -> Path:
    """The folder of the six novels (downloaded and extracted once)."""
    folder = austen_dir()
    if (folder / MANIFEST).is_file():
        return folder
    if shutil.which("apt-get") is None:
        raise FileNotFoundError(f"the Austen text comes from Debian's {PACKAGE} package, and apt-get is not available here")
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            raise FileNotFoundError(f"`apt-get download {PACKAGE}` failed ({done.stderr.strip()[-300:]}); run `apt-get update` first")
        deb = next(Path(tmp).glob("*.deb"))
        novels = read_lazy_load_database(deb_member(deb, RDB_MEMBER))
        with atomic_directory(folder) as staging:
            files = {}
            for index, lines in enumerate(novels):
                title = next((line for line in lines if line.strip()), "untitled").strip()
                name = f"{index}_" + "".join(c if c.isalnum() else "_" for c in title)[:40] + ".txt"
                (staging / name).write_text("\n".join(lines), encoding="utf-8")
                files[name] = sha256_file(staging / name)
            write_json(staging / MANIFEST, {"package": PACKAGE, "deb": deb.name, "deb_sha256": sha256_file(deb), "files": files,
                                            "license": "texts public domain (Project Gutenberg); package MIT (Julia Silge)"})
    return folder


def austen_documents() -> list[str]:
    """The six novels, in the package's order (Sense and Sensibility last, Emma first)."""
    folder = fetch_austen()
    names = sorted(read_json(folder / MANIFEST, expect=dict)["files"], key=lambda n: int(n.split("_", 1)[0]))
    return [(folder / name).read_text(encoding="utf-8") for name in names]

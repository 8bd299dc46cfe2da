"""Texts that install from Debian packages, without root, dpkg or internet beyond the Debian mirror.

``download_deb`` fetches a package with ``apt-get download`` (the one registry slimkv's machines
reach), ``deb_members`` / ``deb_member`` read files out of the .deb (an ``ar`` archive holding
``data.tar.{xz,gz,bz2}``; Python's tarfile reads those, not zstd), and ``fetch_package_texts``
does both once per text: it writes the files a ``build`` function makes from the package, with a
manifest of sha256 hashes, atomically under a cache folder, so later runs read local files only.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from slimkv.common.files import atomic_directory, read_json, sha256_file, write_json

MANIFEST = "manifest.json"
AR_MAGIC = b"!<arch>\n"


def download_deb(package: str, folder: Path) -> Path:
    """The .deb of ``package`` downloaded into ``folder`` with ``apt-get download``;
    FileNotFoundError naming the package if apt-get is missing or fails."""
    if shutil.which("apt-get") is None:
        raise FileNotFoundError(f"this text comes from Debian's {package} package, and apt-get is not available here")
    done = subprocess.run(["apt-get", "download", package], cwd=folder, capture_output=True, text=True)
    debs = sorted(Path(folder).glob(f"{package}_*.deb"))
    if done.returncode != 0 or not debs:
        raise FileNotFoundError(f"`apt-get download {package}` failed ({done.stderr.strip()[-300:]}); run `apt-get update` first")
    return debs[0]


def _data_archive(deb: Path) -> tuple[str, bytes]:
    """Name and bytes of the ``data.tar.*`` member of a .deb's ar archive."""
    data = Path(deb).read_bytes()
    if not data.startswith(AR_MAGIC):
        raise ValueError(f"{deb} is not a Debian package")
    pos = len(AR_MAGIC)
    while pos + 60 <= len(data):
        name, size = data[pos : pos + 16].decode().strip().rstrip("/"), int(data[pos + 48 : pos + 58].decode().strip())
        if name.startswith("data.tar"):
            return name, data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    raise ValueError(f"{deb} has no data archive")


def deb_members(deb: Path, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """Every regular file of a .deb whose path (without a leading ``./``) ``wanted`` accepts,
    path -> bytes, in archive order; read without dpkg, in one pass over the archive."""
    name, body = _data_archive(deb)
    if name.endswith(".zst"):
        raise ValueError(f"{deb} stores its files as {name} (zstd), which Python's tarfile cannot read")
    found = {}
    with tarfile.open(fileobj=io.BytesIO(body), mode="r|*") as archive:
        for member in archive:
            path = member.name.removeprefix("./")
            if member.isfile() and wanted(path):
                found[path] = archive.extractfile(member).read()
    return found


def deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb, by its path inside the package; FileNotFoundError if it is not there."""
    found = deb_members(deb, lambda path: path == member.removeprefix("./"))
    if not found:
        raise FileNotFoundError(f"{member} is not in {deb}")
    return next(iter(found.values()))


def fetch_package_texts(folder: Path, package: str, build: Callable[[Path], dict[str, bytes]], license_note: str) -> Path:
    """``folder`` holding the files ``build(deb)`` makes from Debian's ``package`` (file name ->
    bytes) and a manifest (package, .deb hash, file hashes, ``license_note``); downloaded and built once,
    published atomically so an interrupted run leaves no half-written text."""
    if (folder / MANIFEST).is_file():
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        deb = download_deb(package, Path(tmp))
        made = build(deb)
        with atomic_directory(folder) as staging:
            files = {}
            for name, data in made.items():
                if Path(name).name != name or name == MANIFEST:
                    raise ValueError(f"{package}: cannot store a text file named {name!r} (plain file names only)")
                (staging / name).write_bytes(data)
                files[name] = sha256_file(staging / name)
            write_json(staging / MANIFEST, {"package": package, "deb": deb.name, "deb_sha256": sha256_file(deb), "files": files,
                                            "license": license_note})
    return folder


def package_files(folder: Path) -> list[Path]:
    """The files of a ``fetch_package_texts`` folder, in the order its build made them."""
    return [folder / name for name in read_json(folder / MANIFEST, expect=dict)["files"]]

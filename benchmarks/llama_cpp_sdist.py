"""llama-cpp-python's pinned source distribution, downloaded once and sha256-checked.

llama-cpp-python vendors llama.cpp (``vendor/llama.cpp`` in its sdist), so one
pinned sdist gives both llama.cpp's tokenizer test data
(``tests.support.llama_cpp_vocab``) and the sources ``benchmarks.llama_server``
builds llama-server from. ``fetch_sdist(folder)`` runs ``pip download`` (no
dependencies, source only) into ``folder`` the first time and checks the
file's sha256 against the pinned one every time.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

SDIST_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# Where llama.cpp's sources lie inside the sdist's tar.
LLAMA_CPP_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(folder: Path, timeout_s: float = 900.0) -> Path:
    """``folder/llama_cpp_python-0.3.36.tar.gz``, downloaded with ``pip download`` unless a file
    with the pinned sha256 is already there; creates ``folder``.

    Args:
      folder: where the sdist is kept.
      timeout_s: the download's time limit, seconds.

    Raises:
      RuntimeError: ``pip download`` failed or left no file, or the file's sha256 is not the
        pinned one.
      subprocess.TimeoutExpired: the download took more than ``timeout_s``.
    """
    folder = Path(folder)
    sdist = folder / SDIST_NAME
    if not sdist.is_file() or sha256_file(sdist) != SDIST_SHA256:
        folder.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                              f"llama-cpp-python=={SDIST_VERSION}", "-d", str(folder)],
                             capture_output=True, text=True, timeout=timeout_s)
        if res.returncode != 0 or not sdist.is_file():
            raise RuntimeError(f"pip download llama-cpp-python=={SDIST_VERSION} failed: "
                               f"{res.stdout[-1000:]}{res.stderr[-2000:]}")
    digest = sha256_file(sdist)
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{SDIST_NAME} has sha256 {digest}, not the pinned {SDIST_SHA256}")
    return sdist

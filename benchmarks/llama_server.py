"""llama.cpp's own HTTP server (llama-server), built from the pinned llama-cpp-python sdist.

    python -m benchmarks.llama_server --build     # build (or find) the binary, print its path

The llama.cpp sources that llama-cpp-python 0.3.36 vendors (``vendor/llama.cpp``
of its sdist, ``benchmarks.llama_cpp_sdist``) are extracted to
``cache_dir("llama-server")/0.3.36/src`` and configured with cmake (Release,
``GGML_NATIVE=ON``, static libraries, no tests or examples, no OpenSSL, no
libcurl, no web UI download or npm build: nothing is fetched while building);
only the ``llama-server`` target is built, at ``nice`` 19 with ``-j`` jobs.
The binary is copied to ``cache_dir("llama-server")/0.3.36/bin/llama-server``;
a later call finds it there and builds nothing (delete that ``bin`` folder to
build again; the build tree beside it makes a rebuild incremental). The build
log is ``.../0.3.36/build.log``.

``LlamaServer`` runs that binary on a free loopback port (continuous batching,
``-np`` slots, ``-t`` threads), waits for ``GET /health`` and kills it on
exit; its log lies in a temporary folder and its tail is printed when it fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from benchmarks.llama_cpp_sdist import LLAMA_CPP_PREFIX, SDIST_VERSION, fetch_sdist

SERVER_TARGET = "llama-server"
# Exit codes (killed by these signals) after which LlamaServer retries with AMX denied.
AMX_FAULTS = (-signal.SIGILL, -signal.SIGSEGV)

# cmake cache options: everything that could download (OpenSSL/libcurl for model URLs, the
# prebuilt web UI from a Hugging Face bucket, an npm UI build) off; only common + tools on.
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "ON",
    "LLAMA_BUILD_COMMON": "ON",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_APP": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_CURL": "OFF",  # deprecated in this version (a warning); kept so older trees do not fetch
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_LLGUIDANCE": "OFF",
}


def install_root() -> Path:
    """``cache_dir("llama-server")/<sdist version>``: sources, build tree, log and binary."""
    from serving.config.server_config import cache_dir

    return cache_dir("llama-server") / SDIST_VERSION


def binary_path(root: Path | None = None) -> Path:
    """Where the built ``llama-server`` binary is kept (it may not exist yet)."""
    return (root or install_root()) / "bin" / SERVER_TARGET


def configure_command(src: Path, build: Path, generator: str | None = None,
                      options: dict[str, str] | None = None) -> list[str]:
    """The ``cmake`` configure command line: ``-S src -B build [-G generator] -DK=V...``
    (``CMAKE_OPTIONS``, updated with ``options``)."""
    opts = dict(CMAKE_OPTIONS, **(options or {}))
    cmd = ["cmake", "-S", str(src), "-B", str(build)]
    if generator:
        cmd += ["-G", generator]
    return cmd + [f"-D{k}={v}" for k, v in opts.items()]


def build_command(build: Path, jobs: int) -> list[str]:
    """The ``cmake --build`` command line for the ``llama-server`` target only, ``jobs`` jobs."""
    return ["cmake", "--build", str(build), "--target", SERVER_TARGET, "-j", str(jobs)]


def extract_sources(sdist: Path, dest: Path) -> Path:
    """Extracts the sdist's ``vendor/llama.cpp`` tree into ``dest`` (once: a ``.complete``
    marker); returns ``dest``. Members outside that tree are skipped; tarfile's ``data``
    filter refuses absolute paths, ``..`` and links that leave ``dest``.

    Raises:
      tarfile.TarError: the archive is corrupt or a member is refused by the filter.
    """
    done = dest / ".complete"
    if done.is_file():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(LLAMA_CPP_PREFIX) and len(m.name) > len(LLAMA_CPP_PREFIX):
                m.name = m.name[len(LLAMA_CPP_PREFIX):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    done.touch()
    return dest


def _niced(level: int):
    return (lambda: os.nice(level)) if level else None


def _print(line: str) -> None:
    print(line, flush=True)


def ensure_built(jobs: int = 2, nice: int = 19, log=_print) -> Path:
    """The ``llama-server`` binary, built first if it is not in ``install_root()/bin``.

    Downloads the sdist (``benchmarks.llama_cpp_sdist.fetch_sdist``) into ``install_root()``,
    extracts llama.cpp, configures and builds the ``llama-server`` target at niceness
    ``nice`` with ``jobs`` jobs, writing cmake's output to ``install_root()/build.log``;
    ``log`` gets a line before the build and one with its wall time (seconds) after it.

    Raises:
      RuntimeError: ``cmake`` is not on PATH, the sdist download or check failed, or the
        configure or build step failed (the message ends with the log's last lines).
    """
    root = install_root()
    binary = binary_path(root)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not on PATH: it is needed to build llama-server")
    t0 = time.perf_counter()
    log(f"llama-server: not built yet; building it from llama-cpp-python {SDIST_VERSION}'s llama.cpp "
        f"into {root} (cmake, -j{jobs}, nice {nice}; several minutes on 2 cores; log {root / 'build.log'})")
    src = extract_sources(fetch_sdist(root), root / "src")
    build = root / "build"
    generator = "Ninja" if shutil.which("ninja") else None
    with open(root / "build.log", "w") as out:
        for cmd in (configure_command(src, build, generator), build_command(build, jobs)):
            out.write("$ " + " ".join(cmd) + "\n")
            out.flush()
            res = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_niced(nice))
            if res.returncode != 0:
                raise RuntimeError(f"{cmd[0]} {cmd[1]} failed (exit {res.returncode}); the end of "
                                   f"{root / 'build.log'}:\n{log_tail(root / 'build.log')}")
    built = build / "bin" / SERVER_TARGET
    if not built.is_file():
        raise RuntimeError(f"the build finished but left no {built}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(binary)
    log(f"llama-server: built in {time.perf_counter() - t0:.0f} s: {binary}")
    return binary


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a text file ("" if it does not exist)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def can_build() -> bool:
    """Whether ``ensure_built`` can give a binary here: it is built already, or cmake and a C++
    compiler (c++, g++ or clang++) are on PATH. The build itself may still fail."""
    if binary_path().is_file():
        return True
    return shutil.which("cmake") is not None and any(shutil.which(c) for c in ("c++", "g++", "clang++"))


def context_size(slots: int, longest_prompt: int, output_len: int, block: int = 256) -> int:
    """``-c`` for ``slots`` slots: each slot gets ``-c / slots`` tokens of KV cache (llama-server
    splits it when ``-np`` is given), so each slot's share holds the longest prompt, the
    completion and 8 tokens of margin, rounded up to ``block`` tokens."""
    per_slot = -(-(longest_prompt + output_len + 8) // block) * block
    return slots * per_slot


def server_command(binary: Path, gguf: Path, port: int, slots: int, threads: int, ctx: int) -> list[str]:
    """llama-server's command line: the GGUF, loopback ``port``, ``slots`` slots with continuous
    batching, ``threads`` threads for decode and prompt processing, ``ctx`` tokens of KV cache in
    all, no web UI; every other setting llama-server's default."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-cb", "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "--no-webui"]


class LlamaServer:
    """llama-server on a free loopback port, healthy on return; a context manager that kills it.

    Starts ``server_command(...)`` with stdout and stderr to ``workdir/llama-server.log``,
    polls ``GET /health`` until 200, then sends one 4-token completion (the first decode).
    If the process dies of SIGILL or SIGSEGV before that completes (a native build with AMX
    code on a machine that advertises AMX but faults on it: on a 2-core KVM Xeon, 2026-12-06,
    SIGSEGV on ``ldtilecfg`` in ``ggml_backend_amx_mul_mat`` during its start-up warm-up
    decode), it is started once more with AMX denied to it (``baselines.deny_amx_permission``
    in the child before exec: llama.cpp then keeps its other kernels); ``amx_denied`` says so.

    Raises:
      RuntimeError: the process exited, or was not healthy and done with the probe within
        ``timeout_s`` seconds (the message ends with the log's last lines); it is killed first.
    """

    def __init__(self, binary: Path, gguf: Path, workdir: Path, slots: int, threads: int, ctx: int,
                 timeout_s: float = 300.0):
        from benchmarks.baselines import deny_amx_permission
        from benchmarks.common import free_port

        self.log_path = Path(workdir) / "llama-server.log"
        self.proc: subprocess.Popen | None = None
        self.amx_denied = False
        for deny_amx in (False, True):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.command = server_command(binary, gguf, self.port, slots, threads, ctx)
            self.amx_denied = deny_amx
            with open(self.log_path, "w") as log:
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL,
                                             preexec_fn=deny_amx_permission if deny_amx else None)
            try:
                if self._ready(timeout_s):
                    return
            except BaseException:  # e.g. KeyboardInterrupt: leave no process behind
                self.stop()
                raise
            code = self.proc.returncode
            self.stop()
            if code in AMX_FAULTS and not deny_amx:
                print(f"   llama-server died of {signal.Signals(-code).name} (e.g. AMX code this machine "
                      "advertises but faults on): starting it again with AMX denied to it", flush=True)
                continue
            break
        why = f"not ready within {timeout_s:.0f} s (killed)" if code is None else f"exited with {code}"
        raise RuntimeError(f"llama-server {why}; the end of its log:\n{log_tail(self.log_path)}")

    def _ready(self, timeout_s: float) -> bool:
        import httpx

        deadline = time.time() + timeout_s
        healthy = False
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if not healthy:
                    healthy = httpx.get(f"{self.url}/health", timeout=2).status_code == 200
                if healthy:
                    r = httpx.post(f"{self.url}/completion", json={"prompt": "Hello", "n_predict": 4},
                                   timeout=max(1.0, deadline - time.time()))
                    if r.status_code == 200:
                        return True
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        return False

    def stop(self) -> None:
        """Terminates the process (SIGKILL after 30 s) and waits for it; safe to call twice."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="build llama-server if needed, print its path")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="parallel build jobs")
    ap.add_argument("--nice", type=int, default=19, help="niceness of the build")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 2
    print(ensure_built(args.jobs, args.nice))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

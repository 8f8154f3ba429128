"""llama.cpp's own tokenizer test data, from llama-cpp-python's source distribution.

llama.cpp ships, for each of a set of vocabularies, ``models/ggml-vocab-NAME.gguf``
(the vocabulary only) with ``NAME.gguf.inp`` (inputs separated by
``\\n__ggml_vocab_test__\\n``) and ``NAME.gguf.out`` (the expected ids, one
line per input); ``tests/test-tokenizer-0.cpp`` checks them with
``llama_tokenize(..., add_special=false, parse_special=false)``. llama-cpp-python
vendors llama.cpp, so its sdist on PyPI carries the files. The pinned sdist is
downloaded once with ``pip download`` (its sha256 checked; ``benchmarks.llama_cpp_sdist``) into
``cache_dir("llama-cpp-vocab")`` under ``XLASERVE_DATA_DIR``, and only the
``models/ggml-vocab-*`` members are extracted. A failed download fails the test.

``python -m tests.support.llama_cpp_vocab`` prints, per vocabulary, the cases and
how many give equal ids through ``BPETokenizer.from_gguf``.
"""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

from benchmarks.llama_cpp_sdist import LLAMA_CPP_PREFIX, SDIST_NAME, SDIST_SHA256, SDIST_VERSION, fetch_sdist

__all__ = ["SDIST_NAME", "SDIST_SHA256", "SDIST_VERSION", "TESTED_VOCABS", "models_dir", "tokenizer_cache",
           "vocab_cases"]

_MEMBER_PREFIX = LLAMA_CPP_PREFIX + "models/"
SEPARATOR = "\n__ggml_vocab_test__\n"

# The vocabularies with .inp/.out pairs in that sdist (a new one must be added here, and pass).
TESTED_VOCABS = (
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
    "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)


def models_dir() -> Path:
    """The extracted ``vendor/llama.cpp/models`` folder (downloading the sdist the first time).

    Raises:
      RuntimeError: ``pip download`` failed, or the file's sha256 is not the pinned one.
    """
    from serving.config.server_config import cache_dir

    root = cache_dir("llama-cpp-vocab") / SDIST_VERSION
    done = root / "models" / ".complete"
    if done.is_file():
        return root / "models"
    sdist = fetch_sdist(root)
    out = root / "models"
    out.mkdir(exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            name = m.name[len(_MEMBER_PREFIX):] if m.name.startswith(_MEMBER_PREFIX) else ""
            if m.isfile() and name.startswith("ggml-vocab-") and "/" not in name:
                src = tar.extractfile(m)
                assert src is not None
                (out / name).write_bytes(src.read())
    done.touch()
    return out


def tokenizer_cache() -> Path:
    """``cache_dir("tokenizer")/llama-cpp-vocab-<hash>``: the hash covers the source of the
    modules that turn a GGUF vocabulary into a tokenizer, so editing them invalidates it."""
    from model import bpe_convert, bpe_tokenizer, gguf_pretokenizers, gguf_vocab
    from serving.config.server_config import cache_dir

    h = hashlib.sha256()
    for mod in (bpe_convert, bpe_tokenizer, gguf_pretokenizers, gguf_vocab):
        h.update(Path(mod.__file__).read_bytes())
    d = cache_dir("tokenizer") / f"llama-cpp-vocab-{h.hexdigest()[:16]}"
    d.mkdir(exist_ok=True)
    return d


def vocab_cases(models: Path, name: str) -> list[tuple[str, list[int]]]:
    """``(input, expected ids)`` of one vocabulary, read as ``test-tokenizer-0.cpp`` reads them
    (split on the separator; a trailing empty remainder is no case; each output line stripped
    and split on spaces)."""
    raw = (models / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    outs = (models / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    inputs = raw.split(SEPARATOR)
    if inputs and inputs[-1] == "":
        inputs.pop()
    if len(outs) < len(inputs):
        raise ValueError(f"{name}: {len(inputs)} inputs but {len(outs)} output lines")
    return [(s, [int(x) for x in o.strip().split()]) for s, o in zip(inputs, outs)]


def main() -> None:
    from model.bpe_tokenizer import BPETokenizer

    models = models_dir()
    total = equal = 0
    for name in TESTED_VOCABS:
        tok = BPETokenizer.from_gguf(models / f"ggml-vocab-{name}.gguf", cache_dir=tokenizer_cache())
        cases = vocab_cases(models, name)
        ok = sum(tok.encode(s) == want for s, want in cases)
        total, equal = total + len(cases), equal + ok
        print(f"{name:16s} cases {len(cases):3d}  equal ids {ok:3d}")
    print(f"{len(TESTED_VOCABS)} vocabularies: {equal}/{total} cases give llama.cpp's ids")


if __name__ == "__main__":
    main()

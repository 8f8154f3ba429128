"""Prefix-cache page keys of prompts with images (``serving.core.kv.kv_cache_manager``): an
image's digest is hashed into every page holding one of its soft tokens, and through the
chained keys into every page after it; pages before it, and text-only prompts, hash as
they always did."""

from __future__ import annotations

from serving.core.kv.kv_cache_manager import KVCacheManager, page_extra, page_hash, prompt_page_hashes

PS = 4
PROMPT = [1, 7, 8, 9] + [3] + [99] * 6 + [4] + [5, 6, 7, 8]  # image soft tokens (99) at [5, 11)


def test_image_digests_key_the_pages_that_hold_or_follow_the_image():
    plain = prompt_page_hashes(PROMPT, PS, "salt")
    a = prompt_page_hashes(PROMPT, PS, "salt", images=[(5, 11, "digest-a")])
    a2 = prompt_page_hashes(PROMPT, PS, "salt", images=[(5, 11, "digest-a")])
    b = prompt_page_hashes(PROMPT, PS, "salt", images=[(5, 11, "digest-b")])
    assert len(plain) == len(a) == 4
    assert a == a2  # the same image: the same keys
    assert plain[0] == a[0] == b[0]  # page 0 ([0, 4)) holds no image token
    assert all(x != y for x, y in zip(a[1:], b[1:]))  # pages 1-3: the image, or after it
    assert all(x != y for x, y in zip(a[1:], plain[1:]))
    # text-only keys are the old ones: H(parent, salt, tokens), no image field
    assert plain[0] == page_hash(None, PROMPT[:4], "salt")
    assert [page_extra([(5, 11, "d")], i, PS) for i in range(4)] == ["", "d", "d", ""]


def test_lookup_finds_the_same_image_and_not_another():
    kv = KVCacheManager(num_pages=16, page_size=PS)
    images_a = [(5, 11, "digest-a")]
    assert kv.allocate_pages("r1", len(PROMPT))
    kv.cache_pages("r1", PROMPT, len(PROMPT), None, images_a)
    assert kv.lookup_prefix(PROMPT, None, len(PROMPT), images=images_a).num_tokens == 16
    assert kv.lookup_prefix(PROMPT, None, len(PROMPT), images=[(5, 11, "digest-b")]).num_tokens == 4
    assert kv.lookup_prefix(PROMPT, None, len(PROMPT)).num_tokens == 4  # the text alone: no image
    kv.check_invariants()

"""IncrementalDetokenizer: UTF-8 safety and stop strings (byte-level fake tokenizer)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.output.detokenizer import IncrementalDetokenizer
from tests.support.gateway_fakes import BYTE_OFFSET, END_OF_TURN_ID, FakeTokenizer

TOK = FakeTokenizer()
FFFD = "\ufffd"

texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=FFFD), max_size=60)
# Mostly multi-byte characters, to exercise splits.
wide_chars = st.sampled_from(list("aé中😀ß€\n "))
wide_texts = st.lists(wide_chars, max_size=40).map("".join)


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(ids[i : i + n])
        i += n
        k += 1
    return out


def _stream(text: str, stop=(), sizes=(1,)) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(TOK, stop)
    deltas = []
    for piece in _chunks(TOK.encode(text), list(sizes)):
        deltas.append(d.add(piece))
        if d.stopped:
            break
    deltas.append(d.flush())
    return deltas, d


def _expected_cut(text: str, stops) -> str:
    """Text before the earliest-completing stop (ties: earliest start)."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return text if best is None else text[: best[1]]


@settings(max_examples=300, deadline=None)
@given(st.one_of(texts, wide_texts), st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_any_text_streams_back_exactly_without_replacement_chars(text, sizes):
    deltas, d = _stream(text, sizes=sizes)
    assert "".join(deltas) == text
    assert d.text == text
    assert not any(FFFD in x for x in deltas)


def test_multibyte_character_held_until_complete():
    d = IncrementalDetokenizer(TOK)
    ids = TOK.encode("中")
    assert len(ids) == 3
    assert d.add(ids[:1]) == ""
    assert d.add(ids[1:2]) == ""
    assert d.add(ids[2:]) == "中"
    assert d.flush() == ""


def test_one_batch_with_complete_and_partial_characters():
    d = IncrementalDetokenizer(TOK)
    ids = TOK.encode("中中")
    assert d.add(ids[:5]) == "中"
    assert d.add(ids[5:]) == "中"


def test_incomplete_character_at_end_flushes_as_replacement():
    d = IncrementalDetokenizer(TOK)
    assert d.add(TOK.encode("a中")[:3]) == "a"
    assert d.flush() == FFFD


def test_invalid_bytes_do_not_stall_the_stream():
    d = IncrementalDetokenizer(TOK)
    bad = [BYTE_OFFSET + 0xFF] * 10
    out = "".join(d.add([t]) for t in bad)
    assert out and set(out) == {FFFD}  # emitted while streaming, not only at flush
    out += d.add(TOK.encode("ok")) + d.flush()
    assert out.endswith("ok")


def test_control_tokens_decode_to_nothing():
    d = IncrementalDetokenizer(TOK)
    out = d.add(TOK.encode("hi")) + d.add([END_OF_TURN_ID]) + d.add(TOK.encode("!")) + d.flush()
    assert out == "hi!"


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(texts, wide_texts),
    st.lists(st.one_of(texts, wide_texts).filter(bool).map(lambda s: s[:6]), max_size=4),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
)
def test_stop_strings_never_leak(text, stops, sizes):
    deltas, d = _stream(text, stop=stops, sizes=sizes)
    out = "".join(deltas)
    assert out == _expected_cut(text, stops)
    assert d.stopped == any(s and s in text for s in stops)
    # No emitted prefix ever contains a stop string.
    acc = ""
    for x in deltas:
        acc += x
        assert not any(s in acc for s in stops if s)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(texts, wide_texts),
    st.one_of(texts, wide_texts).filter(bool).map(lambda s: s[:5]),
    st.one_of(texts, wide_texts),
)
def test_stop_string_inserted_in_text_cuts_right_before_it(before, stop, after):
    text = before + stop + after
    deltas, d = _stream(text, stop=[stop])
    assert d.stopped and d.stop_string == stop
    assert "".join(deltas) == text[: text.find(stop)]


def test_stop_string_spanning_tokens():
    deltas, d = _stream("Hello STOP world", stop=["STOP"])
    assert "".join(deltas) == "Hello "
    assert d.stopped and d.text == "Hello "
    assert not any("S" in x for x in deltas)


def test_multibyte_stop_string_across_byte_tokens():
    deltas, d = _stream("abc中文def", stop=["文d"])
    assert "".join(deltas) == "abc中"
    assert d.stopped


def test_partial_stop_prefix_released_when_it_does_not_complete():
    d = IncrementalDetokenizer(TOK, ["STOP"])
    out = [d.add([t]) for t in TOK.encode("ST")]
    assert out == ["", ""]
    assert d.add(TOK.encode("x")) == "STx"
    assert d.flush() == ""
    d = IncrementalDetokenizer(TOK, ["STOP"])
    assert d.add(TOK.encode("aSTO")) == "a"
    assert d.flush() == "STO"
    assert not d.stopped


def test_stop_string_at_the_very_start():
    deltas, d = _stream("STOPand more", stop=["STOP"])
    assert all(x == "" for x in deltas)
    assert d.stopped and d.text == ""


def test_several_stop_strings_earliest_wins():
    deltas, d = _stream("one two three", stop=["three", "two", "zzz"])
    assert "".join(deltas) == "one "
    assert d.stop_string == "two"
    # In one batch too.
    d = IncrementalDetokenizer(TOK, ["three", "two"])
    assert d.add(TOK.encode("one two three")) == "one "
    assert d.stop_string == "two"


def test_overlapping_stop_strings_first_completed_wins():
    # "bc" completes before "abcd" does, as it would while generating.
    d = IncrementalDetokenizer(TOK, ["abcd", "bc"])
    assert d.add(TOK.encode("xabcd")) == "xa"
    assert d.stop_string == "bc"


def test_after_stop_nothing_more_is_emitted():
    d = IncrementalDetokenizer(TOK, ["."])
    assert d.add(TOK.encode("Hi. More")) == "Hi"
    assert d.add(TOK.encode("text")) == ""
    assert d.flush() == ""
    assert d.text == "Hi"


def test_window_stays_small():
    d = IncrementalDetokenizer(TOK)
    for t in TOK.encode("x" * 5000 + "中" * 1000):
        d.add([t])
    assert len(d._ids) <= 8
    assert d.text == "x" * 5000 + "中" * 1000


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcx", max_size=30), st.lists(st.sampled_from(["a", "ab", "abc", "bx", "xx"]),
                                                         min_size=1, max_size=3),
       st.integers(0, 12), st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_min_tokens_arms_stop_strings_after_that_many_tokens(text, stops, min_tokens, sizes):
    """A stop string counts only when it completes in the text of a token after the first
    min_tokens (byte tokens here: one character each), whatever the chunking."""
    d = IncrementalDetokenizer(TOK, stops, min_tokens=min_tokens)
    out = []
    for piece in _chunks(TOK.encode(text), sizes):
        out.append(d.add(piece))
        if d.stopped:
            break
    out.append(d.flush())
    ends = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)
            and i + len(s) > min_tokens]
    cut = text[:min(ends)[1]] if ends else text
    assert "".join(out) == cut and d.stopped == bool(ends)


def test_skipped_ids_count_toward_min_tokens():
    d = IncrementalDetokenizer(TOK, ["b"], min_tokens=2)
    d.skip()  # a stop id dropped from the text: the second token is "b", within min_tokens
    assert d.add(TOK.encode("b")) == "b" and not d.stopped
    assert d.add(TOK.encode("ab")) == "a" and d.stopped

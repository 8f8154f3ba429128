"""serving.gateway.tools.reasoning: <think> reasoning split from content in any
chunking, token counts, and whether a prompt leaves the reasoning open."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.tools.reasoning import ReasoningParser, count_reasoning_tokens, prompt_opens_reasoning
from tests.support.stream_chunks import CHUNKINGS


def replay(chunks: list[str], **kw) -> tuple[str, str, ReasoningParser]:
    parser = ReasoningParser(**kw)
    reasoning, content = [], []
    for chunk in chunks + [None]:
        r, c = parser.feed(chunk) if chunk is not None else parser.finish()
        reasoning.append(r)
        content.append(c)
    assert ("".join(reasoning), "".join(content)) == (parser.reasoning, parser.content)
    return parser.reasoning, parser.content, parser


# (output, starts_in_reasoning, reasoning, content, ended)
STREAMS = {
    "qwen3 thinking": (
        "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
        "It is 18 °C and sunny in Paris.",
        False,
        "The user wants the weather in Paris. I should call get_weather.",
        "It is 18 °C and sunny in Paris.", True),
    "deepseek-r1 prompt opened <think>": (
        "Okay, 2 + 2: that is 4.\n</think>\n\nThe answer is **4**.",
        True, "Okay, 2 + 2: that is 4.", "The answer is **4**.", True),
    "qwen3 thinking off (empty think in the prompt)": (
        "Paris is the capital of France.", False, "", "Paris is the capital of France.", False),
    "distill repeating the opened <think>": (
        "<think>\nHmm.\n\nLet me see: </thin is no marker.\n</think>Done.",
        True, "Hmm.\n\nLet me see: </thin is no marker.", "Done.", True),
    "leading whitespace before <think>": (
        "\n <think>a<b</think>\nc\n", False, "a<b", "c\n", True),
    "<think> later on is content": (
        "Answer first. <think>not reasoning</think>", False, "",
        "Answer first. <think>not reasoning</think>", False),
    "a second </think> is content": (
        "<think>r</think>c</think>d", False, "r", "c</think>d", True),
    "cut off in the reasoning": (
        "<think>\nStep 1: look up the forecast.\n", False, "Step 1: look up the forecast.\n", "", False),
    "only the start of a marker": ("<thi", False, "", "<thi", False),
    "empty output": ("", False, "", "", False),
}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("stream", STREAMS)
def test_recorded_streams_in_any_chunking(stream, chunking):
    text, opened, reasoning, content, ended = STREAMS[stream]
    got = replay(CHUNKINGS[chunking](text), starts_in_reasoning=opened)
    assert (got[0], got[1], got[2].ended) == (reasoning, content, ended)


@settings(max_examples=40, deadline=None)
@given(stream=st.sampled_from(sorted(STREAMS)), data=st.data())
def test_any_split_points(stream, data):
    text, opened, reasoning, content, _ = STREAMS[stream]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=10)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert replay(chunks, starts_in_reasoning=opened)[:2] == (reasoning, content)


def test_a_split_marker_is_held_back_and_never_shown():
    parser = ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\nI think") == ("I think", "")
    assert parser.feed(" so.</thi") == (" so.", "")
    assert parser.feed("nk>\n") == ("", "")
    assert parser.ended
    assert parser.feed("\nYes.") == ("", "Yes.")
    assert parser.finish() == ("", "")


def test_other_markers():
    got = replay(["<|begin_of_thought|>a<|end_of_thought|>b"], start="<|begin_of_thought|>",
                 end="<|end_of_thought|>")
    assert got[:2] == ("a", "b")
    with pytest.raises(ValueError):
        ReasoningParser(start="")


def test_feed_after_finish_raises():
    parser = ReasoningParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


START, END = 151667, 151668          # Qwen3's <think>, </think>


@pytest.mark.parametrize("k", [0, 1, 7])
def test_count_reasoning_tokens(k):
    thinking, answer = list(range(100, 100 + k)), [5, 6, 7]
    assert count_reasoning_tokens(thinking + [END] + answer, START, END, True) == k
    assert count_reasoning_tokens([START] + thinking + [END] + answer, START, END, False) == k
    assert count_reasoning_tokens([START] + thinking + [END] + answer, START, END, True) == k
    assert count_reasoning_tokens([START] + thinking, START, END, False) == k    # cut off
    assert count_reasoning_tokens(thinking + answer, START, END, True) == k + 3
    assert count_reasoning_tokens(answer + [END], START, END, False) == 0      # never started


def test_prompt_opens_reasoning():
    user, assistant = [1, 2, 3], [4]
    assert prompt_opens_reasoning(user + assistant + [START, 198], START, END)   # "<think>\n"
    assert not prompt_opens_reasoning(user + assistant + [START, 198, 198, END, 198], START, END)
    assert not prompt_opens_reasoning(user + assistant, START, END)
    history = [START, 9, END, 10]                  # a past turn's reasoning
    assert prompt_opens_reasoning(history + user + [START], START, END)
    assert not prompt_opens_reasoning(history + user, START, END)

"""serving.gateway.tools.tool_parsers: recorded-looking model outputs of each
format, replayed in deltas of 1 token, 3 tokens, all at once and character by
character, give the same calls and the same content, and their deltas
reassemble into those calls."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.tools.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    ToolCall,
    ToolCallDelta,
    new_call_id,
    tool_parser,
)
from tests.support.stream_chunks import CHUNKINGS, tokens


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def check_deltas(parser, deltas: list[ToolCallDelta]) -> None:
    """Per index: the first delta has id and name and no arguments, the rest
    only arguments, which concatenated are the call's; indexes count up."""
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        if d.index not in streamed:
            assert d.index == len(streamed)
            assert d.id is not None and d.name is not None and d.arguments == ""
            streamed[d.index] = [d.id, d.name, ""]
        else:
            assert d.id is None and d.name is None and d.arguments
            streamed[d.index][2] += d.arguments
    complete = [tuple(v) for i, v in streamed.items() if i not in parser.abandoned]
    assert complete == [(c.id, c.name, c.arguments) for c in parser.calls]


def replay(fmt: str, chunks: list[str], tool_names=None):
    """(content, [(name, arguments)], parser) after feeding `chunks` and finishing."""
    parser = tool_parser(fmt)(tool_names, new_id=ids())
    content, deltas = [], []
    for chunk in chunks + [None]:
        c, d = parser.feed(chunk) if chunk is not None else parser.finish()
        content.append(c)
        deltas += d
    check_deltas(parser, deltas)
    return "".join(content), [(c.name, c.arguments) for c in parser.calls], parser


WEATHER = ["get_weather", "get_time", "search"]

# (format, model output, content, calls)
STREAMS = {
    "qwen3 text then two calls": (
        "hermes",
        "I'll check the weather in Paris and the local time there.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
        "I'll check the weather in Paris and the local time there.",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
         ("get_time", '{"timezone": "Europe/Paris"}')]),
    "qwen3 nested arguments, escapes, brackets in strings": (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"query": "JAX \\"shard_map\\" {vs} [pjit]",'
        ' "filters": {"year": [2024, 2025], "lang": null, "city": "Z\\u00fcrich"}, "limit": 5}}\n'
        "</tool_call>",
        "",
        [("search", '{"query": "JAX \\"shard_map\\" {vs} [pjit]", "filters": {"year": [2024, 2025],'
                    ' "lang": null, "city": "Z\\u00fcrich"}, "limit": 5}')]),
    "hermes call then text": (
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nOne moment, please.',
        "\n\nOne moment, please.",
        [("get_time", "{}")]),
    "hermes plain answer": (
        "hermes",
        "The weather in Paris is 18 °C and sunny.\n",
        "The weather in Paris is 18 °C and sunny.\n",
        []),
    "hermes tag mentioned in prose": (
        "hermes",
        "Write <tool_call> and then the JSON; <tool_ is only a prefix.",
        "Write <tool_call> and then the JSON; <tool_ is only a prefix.",
        []),
    "llama3.1 python_tag call": (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA",'
        ' "unit": "fahrenheit"}}',
        "",
        [("get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}')]),
    "llama3.2 two calls separated by ;": (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "Europe/Paris"}')]),
    "llama3 call with a type key": (
        "llama3_json",
        '{"type": "function", "name": "get_time", "parameters": {"timezone": "UTC"}}',
        "",
        [("get_time", '{"timezone": "UTC"}')]),
    "llama3 plain answer": (
        "llama3_json",
        "It is sunny in Paris today {according to the forecast}.",
        "It is sunny in Paris today {according to the forecast}.",
        []),
    "llama3 JSON that is no call": (
        "llama3_json",
        '{"city": "Paris", "temperature": 18}',
        '{"city": "Paris", "temperature": 18}',
        []),
    "gemma3 call list": (
        "pythonic",
        '[get_weather(city="Paris", unit="celsius"), get_time()]',
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]),
    "gemma3 tool_code fence": (
        "pythonic",
        "```tool_code\n[get_weather(city='Paris'), get_time(timezone=\"Europe/Paris\")]\n```\n",
        "",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"timezone": "Europe/Paris"}')]),
    "llama4 literals of every kind": (
        "pythonic",
        '[search(query="shard_map, pjit (JAX) [x]", filters={"year": [2024, 2025], "lang": None},'
        ' limit=5, exact=False, boost=-1.5, tags=("a", \'b\\\'c\'), strict=true)]',
        "",
        [("search", '{"query": "shard_map, pjit (JAX) [x]", "filters": {"year": [2024, 2025],'
                    ' "lang": null}, "limit": 5, "exact": false, "boost": -1.5, "tags": ["a", "b\'c"],'
                    ' "strict": true}')]),
    "llama4 call list over several lines": (
        "pythonic",
        '[\n    get_weather(city="Paris",\n                unit="celsius"),\n    get_time(),\n]',
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]),
    "pythonic plain answer": (
        "pythonic",
        "Paris is the capital of France.",
        "Paris is the capital of France.",
        []),
    "pythonic list that is no call": (
        "pythonic",
        "[1, 2, 3] are the first three numbers.",
        "[1, 2, 3] are the first three numbers.",
        []),
    "no fence without whitespace after it": (
        "pythonic",
        "```tool_codes\n[get_time()]\n```",
        "```tool_codes\n[get_time()]\n```",
        []),
    "markdown code block is no call": (
        "pythonic",
        "```python\nprint(get_weather(city='Paris'))\n```",
        "```python\nprint(get_weather(city='Paris'))\n```",
        []),
}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("stream", STREAMS)
def test_recorded_streams_in_any_chunking(stream, chunking):
    fmt, text, content, calls = STREAMS[stream]
    got_content, got_calls, _ = replay(fmt, CHUNKINGS[chunking](text), WEATHER)
    assert (got_content, got_calls) == (content, calls)


@settings(max_examples=40, deadline=None)
@given(stream=st.sampled_from(sorted(STREAMS)), data=st.data())
def test_any_split_points(stream, data):
    fmt, text, content, calls = STREAMS[stream]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert replay(fmt, chunks)[:2] == (content, calls)


@pytest.mark.parametrize("fmt, text, name", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "get_weather"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "get_weather"),
    ("pythonic", '[get_weather(city="Paris")]', "get_weather"),
])
def test_a_whole_call_in_one_delta_yields_header_and_arguments(fmt, text, name):
    parser = tool_parser(fmt)(new_id=ids())
    content, deltas = parser.feed(text)
    assert content == ""
    assert deltas == [ToolCallDelta(0, "call_" + "0" * 24, name, ""),
                      ToolCallDelta(0, None, None, '{"city": "Paris"}')]
    assert parser.finish() == ("", [])
    assert parser.calls == [ToolCall("call_" + "0" * 24, name, '{"city": "Paris"}')]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}};'
                    '{"name": "get_time", "parameters": {"tz": "CET"}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}\n'
                    '{"name": "get_time", "parameters": {"tz": "CET"}}'),
    ("pythonic", '[get_weather(city="Paris"), get_time(tz="CET")]'),
])
def test_two_whole_calls_in_one_delta(fmt, text):
    parser = tool_parser(fmt)(new_id=ids())
    content, deltas = parser.feed(text)
    assert [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", ""), (0, None, '{"city": "Paris"}'), (1, "get_time", ""), (1, None, '{"tz": "CET"}')]
    assert content == "" and parser.finish() == ("", [])


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": null}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": ""}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {}, "name": "get_time"}\n</tool_call>'),
    ("llama3_json", '{"name": "get_time", "parameters": {}}'),
    ("llama3_json", '<|python_tag|>{"name": "get_time"}'),
    ("pythonic", "[get_time()]"),
    ("pythonic", "```tool_code\n[get_time( )]\n```"),
])
@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_a_call_without_parameters_has_empty_object_arguments(fmt, text, chunking):
    assert replay(fmt, CHUNKINGS[chunking](text))[:2] == ("", [("get_time", "{}")])


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": " {\\"city\\": \\"Paris\\"} "}'),
])
@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_arguments_given_as_a_json_string_are_unwrapped(fmt, text, chunking):
    assert replay(fmt, CHUNKINGS[chunking](text))[:2] == ("", [("get_weather", '{"city": "Paris"}')])


@pytest.mark.parametrize("fmt, prefix", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": '),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": '),
])
def test_json_arguments_stream_before_the_call_is_complete(fmt, prefix):
    parser = tool_parser(fmt)(new_id=ids())
    arguments = '{"city": "Paris", "days": [1, 2]}'
    sent = []
    for token in tokens(prefix + arguments):
        sent += [d.arguments for d in parser.feed(token)[1]]
    assert len(sent) > 5 and "".join(sent) == arguments   # sent fragment by fragment, before "}"
    assert parser.calls == []
    _, deltas = parser.feed("}" + ("\n</tool_call>" if fmt == "hermes" else ""))
    assert deltas == [] and parser.calls[0].arguments == arguments


def test_a_possible_tag_is_held_back_then_emitted_once():
    parser = HermesToolParser()
    assert parser.feed("Hello <tool_") == ("Hello", [])
    assert parser.feed("box> and <") == (" <tool_box> and", [])
    assert parser.feed("b>") == (" <b>", [])
    assert parser.finish() == ("", [])


def test_whitespace_is_held_only_until_it_is_known_not_to_separate_calls():
    parser = HermesToolParser()
    assert parser.feed("Paris:\n") == ("Paris:", [])
    assert parser.feed("\n") == ("", [])
    assert parser.feed("sunny.") == ("\n\nsunny.", [])
    assert parser.finish() == ("", [])
    assert replay("hermes", ["Hi.", "\n"])[0] == "Hi.\n"   # no call after it: kept


MALFORMED = [
    # (format, output, tool names): all of it is content
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"x": NaN}}\n</tool_call>', None),
    ("hermes", '<tool_call>\nget_weather(city="Paris")\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "not json"}\n</tool_call>', None),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {"path": "/"}}\n</tool_call>', WEATHER),
    ("llama3_json", '{"name": "rm_rf", "parameters": {"path": "/"}}', WEATHER),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris",}}', None),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"Paris weather\")", None),
    ("pythonic", '[get_weather("Paris")]', None),
    ("pythonic", "[get_weather(city=CITY)]", None),
    ("pythonic", "[get_weather(city=1 + 2)]", None),
    ("pythonic", "[get_weather(**kwargs)]", None),
    ("pythonic", "[get_weather(city={1, 2})]", None),
    ("pythonic", "[os.system(cmd='ls')]", None),
    ("pythonic", '[rm_rf(path="/")]', WEATHER),
]


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("fmt, text, names", MALFORMED)
def test_a_malformed_call_is_content(fmt, text, names, chunking):
    assert replay(fmt, CHUNKINGS[chunking](text), names)[:2] == (text, [])


@pytest.mark.parametrize("chunking", CHUNKINGS)
def test_a_malformed_block_between_calls_is_content_and_the_rest_still_parses(chunking):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}, oops}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    content, calls, parser = replay("hermes", CHUNKINGS[chunking](text))
    # the whitespace before it is kept with it (only whitespace between calls is dropped)
    assert content == '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}, oops}\n</tool_call>'
    assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]
    # Fed piecemeal, its first delta went out before the JSON broke: index 1 is
    # abandoned and the next call is index 2; fed whole, it never got an index.
    if chunking == "all at once":
        assert parser.abandoned == [] and [c.id[-1] for c in parser.calls] == ["0", "1"]
    else:
        assert parser.abandoned == [1] and [c.id[-1] for c in parser.calls] == ["0", "2"]


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("fmt, text, content, calls, abandoned", [
    # cut off inside the JSON: the call's text is content, its deltas abandoned
    ("hermes", 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [], [0]),
    ("hermes", "<tool_call>\n", "<tool_call>\n", [], []),
    ("hermes", '<tool_call>\n{"name": "get_w', '<tool_call>\n{"name": "get_w', [], []),
    # the JSON is complete, the close tag is missing or cut off: a call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     "", [("get_weather", '{"city": "Paris"}')], []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_',
     "", [("get_weather", '{"city": "Paris"}')], []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_ti',
     '{"name": "get_ti', [("get_weather", '{"city": "Paris"}')], []),
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": "C',
     '{"name": "get_time", "parameters": {"tz": "C', [], [0]),
    ("llama3_json", "<|python_tag|>", "<|python_tag|>", [], []),
    ("pythonic", '[get_weather(city="Paris"), get_time(tz="CE',
     ' get_time(tz="CE', [("get_weather", '{"city": "Paris"}')], []),
    ("pythonic", '[get_weather(city="Paris")', "", [("get_weather", '{"city": "Paris"}')], []),
    ("pythonic", "```tool_code\n[get_time()]\n``", "", [("get_time", "{}")], []),
    ("pythonic", "```tool_co", "```tool_co", [], []),
])
def test_finish_on_an_unterminated_call(fmt, text, content, calls, abandoned, chunking):
    got_content, got_calls, parser = replay(fmt, CHUNKINGS[chunking](text))
    assert (got_content, got_calls, parser.abandoned) == (content, calls, abandoned)


def test_text_after_a_call_list_is_content():
    assert replay("pythonic", ["[get_time()]\nDone."])[:2] == ("\nDone.", [("get_time", "{}")])
    assert replay("llama3_json", ['{"name": "get_time"}; and more'])[:2] == (
        "; and more", [("get_time", "{}")])


def test_only_the_start_of_the_output_can_begin_calls():
    text = 'The call is [get_time()] or {"name": "get_time"}.'
    assert replay("pythonic", [text])[:2] == (text, [])
    assert replay("llama3_json", [text])[:2] == (text, [])


def test_default_ids_and_registry():
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())
    assert new_call_id() != new_call_id()
    parser = tool_parser("hermes")()
    parser.feed('<tool_call>{"name": "f"}</tool_call>')
    parser.finish()
    assert re.fullmatch(r"call_[0-9a-f]{24}", parser.calls[0].id)
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                            "pythonic": PythonicToolParser}
    with pytest.raises(ValueError, match="hermes, llama3_json, pythonic"):
        tool_parser("mistral")


def test_feed_after_finish_raises():
    parser = PythonicToolParser()
    parser.finish()
    assert parser.finish() == ("", [])
    with pytest.raises(RuntimeError):
        parser.feed("x")


@pytest.mark.parametrize("fmt", TOOL_PARSERS)
def test_plain_content_is_not_held_back(fmt):
    parser = tool_parser(fmt)()
    assert parser.feed("Paris") == ("Paris", [])
    assert parser.feed(" is the capital") == (" is the capital", [])
    assert parser.feed(" of France.") == (" of France.", [])
    assert parser.finish() == ("", [])


@pytest.mark.parametrize("fmt, head, tail", [
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"text": "', '"}}\n</tool_call>'),
    ("llama3_json", '{"name": "search", "parameters": {"text": "', '"}}'),
    ("pythonic", '[search(text="', '")]'),
])
def test_a_long_call_token_by_token_stays_fast(fmt, head, tail):
    text = head + "lorem ipsum \\\"dolor\\\" sit amet, " * 2000 + tail    # ~60 kB, ~20k tokens
    content, calls, _ = replay(fmt, tokens(text))
    assert content == "" and len(calls) == 1 and len(calls[0][1]) > 60_000

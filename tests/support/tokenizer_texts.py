"""The texts real tokenizers are compared on: the shared tokenizer cases
(tests/data/gemma3_tokenizer_cases.json) plus code, CJK, emoji and whitespace runs."""

from __future__ import annotations

import json

from tests.support.paths import TEST_DATA

EXTRA = {
    "code_rust": "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n"
                 "    println!(\"{:?}\", v);\n}\n",
    "code_js_tabs": "const f = async (a, b) => {\n\treturn await a?.b ?? 0x1F;\n};\t// done",
    "cjk_mixed": "中文、日本語の文章、한국어 문장。全角ＡＢＣ１２３「引用」",
    "emoji_runs": "🚀🚀🚀 launch 👩‍💻 at 10:30 🎉🇫🇷 ok👍🏿",
    "whitespace_runs": "a  b   c    d\t\t\te\n\n\n f \r\n\r\n  \u00a0\u3000end   ",
    "specials_as_text": "<|begin_of_text|><|eot_id|>[INST]</s><s><|im_end|><|start_header_id|>",
    "digits_long": "3141592653589793238462643383279 and 1,000,000.00",
    "contractions": "I'm sure they'll say it's what we'd've DONE'S",
}


def tokenizer_texts() -> dict[str, str]:
    """{case name: text}: the shared cases, then ``EXTRA``."""
    cases = json.loads((TEST_DATA / "gemma3_tokenizer_cases.json")
                       .read_text(encoding="utf-8"))["cases"]
    return {**{c["name"]: c["text"] for c in cases}, **EXTRA}

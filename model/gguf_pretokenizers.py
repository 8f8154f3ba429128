"""llama.cpp's pre-tokenizers: ``tokenizer.ggml.pre`` names as ``tokenizers`` split pipelines.

A GGUF with a BPE vocabulary names the way text is cut into words before BPE
in ``tokenizer.ggml.pre``. llama.cpp (``src/llama-vocab.cpp``,
``llm_tokenizer_bpe``; ``src/unicode.cpp`` for the hand-written splitters)
maps each name to a *family*: a list of regular expressions applied in turn
(each splits every piece the previous ones left, keeping both the matches and
the text between them: ``tokenizers``' ``Split(..., "isolated")``), plus two
flags: whether a word that is itself a token skips the merges
(``ignore_merges``) and whether words are spelled in GPT-2's byte alphabet.

The expressions are llama.cpp's (facts carried over, written in Oniguruma's
syntax, which ``tokenizers`` uses). Where llama.cpp rewrote an original
``tokenizer.json`` expression for its own regex engine (``(?i:...)`` spelled
out as ``[sS]``, ``\\p{Lu}`` classes emulated by look-aheads) the original is
used, since Oniguruma reads it; where llama.cpp replaces an expression by a
hand-written splitter (Kimi K2, AFMoE and Tiny Aya digit groups, newline runs)
the expression that splitter implements is written out.

No JAX here: the gateway's tokenizer path imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenizers import Regex, pre_tokenizers

from model.bpe_convert import LLAMA3_PATTERN, QWEN2_PATTERN, TEKKEN_PATTERN

__all__ = ["PreTokenizerFamily", "FAMILIES", "GGUF_PRE_TOKENIZERS", "family", "split_pre_tokenizer"]


@dataclass(frozen=True)
class PreTokenizerFamily:
    """One of llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_*`` split rules.

    Attributes:
      name: llama.cpp's name for the rule (lower case, e.g. "llama3").
      patterns: the expressions, applied in order (Oniguruma syntax).
      ignore_merges: a word that is itself a vocabulary token becomes that
        token without BPE (llama.cpp's ``ignore_merges``; tiktoken's behaviour).
      byte_level: words are spelled in GPT-2's byte alphabet (False: raw UTF-8
        with spaces as "▁", SentencePiece-style BPE such as Gemma 4's).
      nfc: NFC-normalize the text first. llama.cpp normalizes no BPE text;
        only the "qwen2" name sets it, as Qwen2's own ``tokenizer.json`` does
        (the two agree on llama.cpp's Qwen2 test data, which is NFC already).
    """
    name: str
    patterns: tuple[str, ...]
    ignore_merges: bool = False
    byte_level: bool = True
    nfc: bool = False


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = LLAMA3_PATTERN
_QWEN2 = QWEN2_PATTERN
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = TEKKEN_PATTERN
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGIT_GROUPS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"  # 1234567 -> 1 234 567 (unicode.cpp's afmoe splitter)
_NEWLINE_RUNS = r"[^\n]+|[\n]+"
_DEEPSEEK_LLM_LETTERS = (
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}"
    r"\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}"
    r"\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}"
    r"\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}"
    r"\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}"
    r"\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-"
    r"\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}"
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}"
    r"\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}"
    r"\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}"
    r"\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}"
    r"\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}"
    r"\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}"
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-"
    r"\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+")
_DEEPSEEK_LLM_PUNCT = (
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+")
_CJK_HANGUL = (
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+")
_CJK_KANA = (
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+")
_YOUTU_CJK = (
    r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}"
    r"\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]"
    r"+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+")
_BLOOM = (
    r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+")
_AFMOE_CJK = (
    r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"
    r"\x{FF65}-\x{FF9F}\x{2F00}-\x{2FDF}\x{E40}-\x{E7F}\x{E80}-\x{EFF}\x{1780}-\x{17FF}"
    r"\x{1000}-\x{109F}\x{AA60}-\x{AA7F}\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+")
_KIMI_K2 = (r"[\p{Han}]+"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
            + _CONTRACTIONS + "?"
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
            + _CONTRACTIONS + "?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _families() -> dict[str, PreTokenizerFamily]:
    F = PreTokenizerFamily
    out = [
        F("default", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
        F("llama3", (_LLAMA3,), ignore_merges=True),
        F("jais2", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
                    r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",)),
        F("dbrx", (_LLAMA3,)),
        F("deepseek-llm", (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+$", _CJK_HANGUL, r"\p{N}+")),
        F("deepseek3-llm", (r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3)),
        F("spark2_5", (r"\p{N}{1,3}", _CJK_KANA,
                       r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                       r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
        F("youtu", (_YOUTU_CJK,
                    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
                    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
                    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
        F("deepseek-coder", (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
        F("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
        F("starcoder", (r"\p{N}", _GPT2)),
        F("gpt2", (_GPT2,)),
        F("qwen2", (_QWEN2,)),
        F("qwen35", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
        F("bloom", (_BLOOM,)),
        F("chatglm4", (_LLAMA3,)),
        F("viking", (_BLOOM, r"\p{N}")),
        F("tekken", (_TEKKEN,), ignore_merges=True),
        F("chameleon", (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )",
                        r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2)),
        F("gpt-4o", (_GPT4O,)),
        F("granite-embed-multi-97m", (
            rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*{_LOWER}+{_CONTRACTIONS}?"
            rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",), ignore_merges=True),
        F("tiny_aya", (_DIGIT_GROUPS, _GPT4O)),
        F("kimi-k2", (_KIMI_K2,)),
        F("superbpe", (r"\p{N}+", _DIGIT_GROUPS)),
        F("bailingmoe", (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                         r"|\s*[\r\n]|\s+(?!\S)|\s+",)),
        F("seed-coder", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                         r"|\s*[\r\n]+|\s+(?!\S)|\s+",)),
        F("ufakzeka", (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
        F("afmoe", (_DIGIT_GROUPS, _AFMOE_CJK,
                    _DEEPSEEK3)),
        F("laguna", (_NEWLINE_RUNS, _QWEN2)),
        F("exaone-moe", (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                         r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",)),
        F("gemma4", (_NEWLINE_RUNS,), byte_level=False),
        F("minicpm5", (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True),
    ]
    return {f.name: f for f in out}


FAMILIES: dict[str, PreTokenizerFamily] = _families()
"""llama.cpp's split rules by its name for them (``LLAMA_VOCAB_PRE_TYPE_*`` in lower case)."""


def _aliases() -> dict[str, str]:
    groups = {
        "default": ["default"],
        "llama3": ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                   "jina-v5-nano"],
        "jais2": ["jais-2"],
        "dbrx": ["dbrx", "smaug-bpe"],
        "deepseek-llm": ["deepseek-llm"],
        "deepseek-coder": ["deepseek-coder"],
        "deepseek3-llm": ["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"],
        "spark2_5": ["spark2_5"],
        "youtu": ["youtu"],
        "falcon": ["falcon"],
        "starcoder": ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
                      "mellum2"],
        "gpt2": ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                 "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
                 "jina-v1-en", "jina-v2-code", "roberta-bpe"],
        "qwen2": ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                  "solar-open"],
        "qwen35": ["qwen35"],
        "bloom": ["bloom", "poro-chat", "gpt3-finnish"],
        "chatglm4": ["chatglm-bpe"],
        "viking": ["viking"],
        "tekken": ["tekken"],
        "chameleon": ["chameleon"],
        "gpt-4o": ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        "granite-embed-multi-97m": ["granite-embed-multi-97m"],
        "tiny_aya": ["tiny_aya", "cohere2moe"],
        "kimi-k2": ["kimi-k2"],
        "superbpe": ["superbpe"],
        "bailingmoe": ["bailingmoe", "bailingmoe2", "llada-moe"],
        "seed-coder": ["seed-coder"],
        "ufakzeka": ["ufakzeka"],
        "grok-2": ["grok-2"],
        "afmoe": ["afmoe"],
        "laguna": ["laguna"],
        "exaone-moe": ["exaone-moe"],
        "gemma4": ["gemma4", "granite-embed-multi-311m", "sarvam-moe"],
        "minicpm5": ["minicpm5"],
    }
    out = {}
    for fam, names in groups.items():
        for n in names:
            out[n] = "qwen2" if fam == "grok-2" else fam
    out["glm4"] = out["glm5"] = "chatglm4"
    return out


GGUF_PRE_TOKENIZERS: dict[str, str] = _aliases()
"""``tokenizer.ggml.pre`` value -> family name in :data:`FAMILIES`: every name
llama.cpp's ``llama_vocab::impl::load`` accepts for a BPE vocabulary but
"whitespace" (which goes with its own ``tokenizer.ggml.model`` "whitespace",
not read). "sarvam-moe" shares Gemma 4's rule (llama.cpp's two entries are equal).
"grok-2" uses Qwen2's expression (llama.cpp's table gives both the same one);
"glm4"/"glm5" are "chatglm-bpe"'s rule with ``ignore_merges``."""

_IGNORE_MERGES_ALIASES = frozenset({"glm4", "glm5"})
_NFC_ALIASES = frozenset({"qwen2"})


def family(pre: str | None) -> PreTokenizerFamily:
    """The split rule of a ``tokenizer.ggml.pre`` value (None or missing: "default", as llama.cpp).

    Raises:
      ValueError: an unknown name, naming it and listing the known ones.
    """
    name = "default" if pre in (None, "") else pre
    fam = GGUF_PRE_TOKENIZERS.get(name)
    if fam is None:
        raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}; xlaserve reads llama.cpp's "
                         f"{len(GGUF_PRE_TOKENIZERS)} names: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}")
    f = FAMILIES[fam]
    if name in _IGNORE_MERGES_ALIASES:
        f = replace(f, ignore_merges=True)
    if name in _NFC_ALIASES:
        f = replace(f, nfc=True)
    return f


def split_pre_tokenizer(fam: PreTokenizerFamily) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer of a family: its ``Split(pattern, "isolated")``
    steps in order, then (byte-level families) ``ByteLevel(add_prefix_space=False,
    use_regex=False)``, which spells each piece's UTF-8 bytes in GPT-2's alphabet."""
    steps = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in fam.patterns]
    if fam.byte_level:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False))
    return pre_tokenizers.Sequence(steps)

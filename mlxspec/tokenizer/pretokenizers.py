"""llama.cpp's pre-tokenizers: the ``tokenizer.ggml.pre`` names of gpt2 (byte-level BPE) vocabularies,
with the regexes that split text before BPE (``src/llama-vocab.cpp``) and the defaults each name implies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: ``tokenizer.ggml.model`` values this module builds a tokenizer for.
SUPPORTED_MODELS = ("gpt2", "llama", "gemma4")

#: ``tokenizer.ggml.model`` values refused on purpose (other algorithms: WordPiece, RWKV, Unigram, ...).
REFUSED_MODELS = {
    "bert": "WordPiece (BERT) vocabularies are for embedding models",
    "t5": "Unigram (T5) vocabularies are not implemented",
    "rwkv": "RWKV vocabularies are not implemented",
    "plamo2": "PLaMo-2 vocabularies are not implemented",
    "hybriddna": "hybriddna vocabularies are not implemented",
    "whitespace": "whitespace vocabularies are not implemented",
    "no_vocab": "the file has no vocabulary",
    "none": "the file has no vocabulary",
}

# Regexes (Oniguruma syntax, as HF tokenizers runs them). Where llama.cpp adapted a regex from the
# model's tokenizer.json (e.g. turned ``(?i:...)`` into character classes) the original form is used:
# HF tokenizers - and so the reference tokenizations - run the original.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
    + r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_RE_DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[A-Za-z\x{b5}\x{c0}-\x{d6}\x{d8}-\x{f6}\x{f8}-\x{1ba}\x{1bc}-\x{1bf}\x{1c4}-\x{293}\x{295}-\x{2af}\x{370}-\x{373}\x{376}\x{377}\x{37b}-\x{37d}\x{37f}\x{386}\x{388}-\x{38a}\x{38c}\x{38e}-\x{3a1}\x{3a3}-\x{3f5}\x{3f7}-\x{481}\x{48a}-\x{52f}\x{531}-\x{556}\x{10a0}-\x{10c5}\x{13a0}-\x{13f5}\x{13f8}-\x{13fd}\x{1c90}-\x{1cba}\x{1cbd}-\x{1cbf}\x{1d00}-\x{1d2b}\x{1d6b}-\x{1d77}\x{1d79}-\x{1d9a}\x{1e00}-\x{1f15}\x{1f18}-\x{1f1d}\x{1f20}-\x{1f45}\x{1f48}-\x{1f4d}\x{1f50}-\x{1f57}\x{1f59}\x{1f5b}\x{1f5d}\x{1f5f}-\x{1f7d}\x{1f80}-\x{1fb4}\x{1fb6}-\x{1fbc}\x{1fbe}\x{1fc2}-\x{1fc4}\x{1fc6}-\x{1fcc}\x{1fd0}-\x{1fd3}\x{1fd6}-\x{1fdb}\x{1fe0}-\x{1fec}\x{1ff2}-\x{1ff4}\x{1ff6}-\x{1ffc}\x{2102}\x{2107}\x{210a}-\x{2113}\x{2115}\x{2119}-\x{211d}\x{2124}\x{2126}\x{2128}\x{212a}-\x{212d}\x{212f}-\x{2134}\x{2139}\x{213c}-\x{213f}\x{2145}-\x{2149}\x{214e}\x{2183}\x{2184}\x{2c00}-\x{2c7b}\x{2c7e}-\x{2ce4}\x{2ceb}-\x{2cee}\x{2cf2}\x{2cf3}\x{a640}-\x{a66d}\x{a680}-\x{a69b}\x{a722}-\x{a76f}\x{a771}-\x{a787}\x{a78b}-\x{a78e}\x{ab70}-\x{abbf}\x{fb00}-\x{fb06}\x{fb13}-\x{fb17}\x{ff21}-\x{ff3a}\x{ff41}-\x{ff5a}\x{10400}-\x{1044f}\x{104b0}-\x{104d3}\x{104d8}-\x{104fb}\x{10c80}-\x{10cb2}\x{10cc0}-\x{10cf2}\x{118a0}-\x{118df}\x{1e900}-\x{1e943}]+",
    r"\s?[!-/:-~\x{ff01}-\x{ff0f}\x{ff1a}-\x{ff5e}\x{2018}-\x{201f}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]+",
    r"\p{N}+",
]
_RE_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\x{4e00}-\x{9fa5}\x{800}-\x{4e00}\x{ac00}-\x{d7ff}]+", r"\p{N}"]
_RE_DEEPSEEK_V3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_DEEPSEEK_V3 = [r"\p{N}{1,3}", r"[\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+", _RE_DEEPSEEK_V3_MAIN]
_RE_SPARK2_5 = [
    r"\p{N}{1,3}",
    r"[\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+",
    (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
     r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"),
    r"\p{N}",
]
_RE_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _RE_GPT2, r"[0-9][0-9][0-9]"]
_RE_STARCODER = [r"\p{N}", _RE_GPT2]
_RE_PORO = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{ff0c}\x{3001}\x{964}\x{6d4}\x{60c})]+"
_RE_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
_RE_TEKKEN = _RE_CASED_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_GPT4O = (
    _RE_CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_YOUTU = [
    r"[\x{ac00}-\x{d7a3}\x{3131}-\x{318e}]+|[\x{ff01}\x{2026}\x{201c}\x{201d}\x{2018}\x{2019}\x{2014}\x{ff1a}\x{ff1b}\x{ff0c}\x{3001}-\x{303f}\x{fe30}-\x{fe4f}]+|[\x{3105}-\x{312f}]+|[\x{4e00}-\x{9fa5}\x{3040}-\x{309f}\x{30a0}-\x{30ff}]+",
    _RE_CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_RE_TINY_AYA = [r"\d{1,3}(?=(?:\d{3})*\b)", _RE_GPT4O]
_RE_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_BAILINGMOE = r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
_RE_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_RE_MINICPM5 = [
    r"\p{N}{1,3}",
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_RE_EXAONE_MOE = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
_RE_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


@dataclass(frozen=True)
class _Pre:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole token is taken as is (llama3-style)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no tokenizer.ggml.add_bos_token
    no_bos: bool = False  # the model has no BOS token (chatglm)


def _pre(regexes, **kw) -> _Pre:
    if isinstance(regexes, str):
        regexes = [regexes]
    return _Pre(tuple(regexes), **kw)


#: ``tokenizer.ggml.pre`` names accepted for ``tokenizer.ggml.model == "gpt2"`` (llama.cpp's names),
#: with their pre-tokenizer regexes and defaults.
BPE_PRE_TOKENIZERS: dict[str, _Pre] = {}


def _register(names: Iterable[str], pre: _Pre) -> None:
    for n in names:
        BPE_PRE_TOKENIZERS[n] = pre


_register(["default"], _pre(_RE_DEFAULT))
_register(
    ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
    _pre(_RE_LLAMA3, ignore_merges=True, add_bos=True),
)
_register(["dbrx", "smaug-bpe"], _pre(_RE_LLAMA3))
_register(["jais-2"], _pre(_RE_JAIS2))
_register(["deepseek-llm"], _pre(_RE_DEEPSEEK_LLM))
_register(["deepseek-coder"], _pre(_RE_DEEPSEEK_CODER))
_register(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _pre(_RE_DEEPSEEK_V3))
_register(["spark2_5"], _pre(_RE_SPARK2_5))
_register(["youtu"], _pre(_RE_YOUTU, ignore_merges=True))
_register(["falcon"], _pre(_RE_FALCON))
_register(
    ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
    _pre(_RE_STARCODER),
)
_register(
    ["gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "mellum",
     "gigachat", "a.x-4.0", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de"],
    _pre(_RE_GPT2),
)
_register(
    ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"],
    _pre(_RE_QWEN2),
)
_register(["qwen35"], _pre(_RE_QWEN35))
_register(["poro-chat", "bloom", "gpt3-finnish"], _pre(_RE_PORO))
_register(["viking"], _pre([_RE_PORO, r"\p{N}"]))
_register(["chatglm-bpe"], _pre(_RE_LLAMA3, no_bos=True))
_register(["glm4", "glm5"], _pre(_RE_LLAMA3, no_bos=True, ignore_merges=True))
_register(["tekken"], _pre(_RE_TEKKEN, ignore_merges=True, add_bos=True))
_register(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _pre(_RE_GPT4O))
_register(["tiny_aya", "cohere2moe"], _pre(_RE_TINY_AYA))
_register(["seed-coder"], _pre(_RE_SEED_CODER))
_register(["bailingmoe", "bailingmoe2", "llada-moe"], _pre(_RE_BAILINGMOE))
_register(["ufakzeka"], _pre(_RE_UFAKZEKA))
_register(["minicpm5"], _pre(_RE_MINICPM5, ignore_merges=True))
_register(["exaone-moe"], _pre(_RE_EXAONE_MOE))
_register(["laguna"], _pre([r"[^\n]+|[\n]+", _RE_QWEN2]))

#: Pre-tokenizer names checked against llama.cpp's golden tokenizations (tests/test_tokenizer.py).
VERIFIED_BPE_PRE = (
    "gpt-2", "llama-bpe", "qwen2", "qwen35", "starcoder", "refact", "command-r", "falcon",
    "deepseek-llm", "deepseek-coder", "mpt",
)

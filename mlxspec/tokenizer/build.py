"""Tokenizers built from GGUF metadata (or a HuggingFace tokenizer.json), without torch.

``load_gguf_tokenizer(metadata)`` reproduces llama.cpp's tokenization (``src/llama-vocab.cpp``):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with merges; the text is split with the
  pre-tokenizer regexes that ``tokenizer.ggml.pre`` names (see ``BPE_PRE_TOKENIZERS``), applied one
  after the other as llama.cpp does (matches and the gaps between them both become pieces).
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE on scores with byte fallback, spaces
  escaped as U+2581 and a space prepended to each text fragment that starts the text or follows a
  special token.
* ``tokenizer.ggml.model == "gemma4"``: SentencePiece-style BPE with merges (raw UTF-8, byte fallback).

Control (type 3) and user-defined (type 4) tokens are matched as whole tokens in the text before
the rest is tokenized, longest first, the way llama.cpp's ``tokenizer_st_partition`` does; with
``parse_special=False`` only user-defined tokens are (as in llama.cpp).

The BPE merging itself runs in HuggingFace ``tokenizers`` (Rust), so building and encoding are fast.
Everything a caller needs for generation (ids of end-of-generation tokens, a streaming
detokenizer, the chat template) is on the returned :class:`Tokenizer`.
"""

from __future__ import annotations

import codecs
import json
import mmap
import os
import struct
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from mlxspec.errors import MlxspecError

# --------------------------------------------------------------------------------------------
# What this module supports, in one place.
# --------------------------------------------------------------------------------------------

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
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
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

# Token types in GGUF (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end of generation (llama-vocab.cpp, "special_eog_ids").
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})


def supported_summary() -> str:
    """One line naming what load_gguf_tokenizer accepts."""
    return (
        f"supported tokenizer.ggml.model: {', '.join(SUPPORTED_MODELS)}; "
        f"supported tokenizer.ggml.pre for gpt2: {', '.join(sorted(BPE_PRE_TOKENIZERS))}"
    )


# --------------------------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------------------------

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file into python values.

    Strings -> str, numbers -> int/float/bool, arrays of strings -> list[str], numeric arrays ->
    numpy arrays. Only the header is read (the file is memory-mapped), so this is fast even for
    multi-GB model files. The value types follow ``gguf.GGUFValueType``; this parses the header
    directly because ``gguf.GGUFReader`` builds one numpy view per array element and takes
    seconds on 150k-token vocabularies.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise MlxspecError(f"{path}: cannot open GGUF file: {e.strerror}") from None
    with f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise MlxspecError(f"{path}: not a GGUF file (bad magic); pass a .gguf model file")
        endian = "<"
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0 and version != 0:  # written big-endian
            endian = ">"
            (version,) = struct.unpack_from(">I", buf, 4)
        if version < 2:
            raise MlxspecError(f"{path}: GGUF version {version} is too old; reconvert the model")
        _n_tensors, n_kv = struct.unpack_from(endian + "QQ", buf, 8)
        off = 24
        out: dict[str, Any] = {}
        u64 = struct.Struct(endian + "Q")
        u32 = struct.Struct(endian + "I")

        def read_str(o: int) -> tuple[str, int]:
            (n,) = u64.unpack_from(buf, o)
            o += 8
            return buf[o:o + n].decode("utf-8", errors="replace"), o + n

        def read_value(t: int, o: int) -> tuple[Any, int]:
            if t == _GGUF_STRING:
                return read_str(o)
            fmt = _GGUF_SCALARS.get(t)
            if fmt is not None:
                s = struct.calcsize(fmt)
                return struct.unpack_from(endian + fmt, buf, o)[0], o + s
            if t == _GGUF_ARRAY:
                (it,) = u32.unpack_from(buf, o)
                (n,) = u64.unpack_from(buf, o + 4)
                o += 12
                if it == _GGUF_STRING:
                    vals = []
                    append = vals.append
                    unpack = u64.unpack_from
                    for _ in range(n):
                        (ln,) = unpack(buf, o)
                        o += 8
                        append(buf[o:o + ln].decode("utf-8", errors="replace"))
                        o += ln
                    return vals, o
                dt = _GGUF_NP.get(it)
                if dt is not None:
                    dt = np.dtype(dt).newbyteorder(endian)
                    arr = np.frombuffer(buf, dtype=dt, count=n, offset=o).astype(dt.newbyteorder("="))
                    return arr, o + n * dt.itemsize
                vals = []
                for _ in range(n):  # arrays of arrays: rare, keep it simple
                    v, o = read_value(it, o)
                    vals.append(v)
                return vals, o
            raise MlxspecError(f"{path}: unknown GGUF value type {t}; the file may be corrupt")

        try:
            for _ in range(n_kv):
                key, off = read_str(off)
                (t,) = u32.unpack_from(buf, off)
                off += 4
                out[key], off = read_value(t, off)
        except (struct.error, ValueError, IndexError) as e:
            raise MlxspecError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    return out


# --------------------------------------------------------------------------------------------
# Byte-level helpers
# --------------------------------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_ENCODER = _bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}
_SPACE = "\u2581"


def _byte_level_decode(text: str) -> bytes:
    try:
        return bytes(_BYTE_DECODER[c] for c in text)
    except KeyError:  # a character outside GPT-2's map: keep it as UTF-8
        return b"".join(bytes([_BYTE_DECODER[c]]) if c in _BYTE_DECODER else c.encode("utf-8") for c in text)


def _parse_byte_token(text: str) -> int | None:
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, np.ndarray):
        return x.tolist()
    return list(x)


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------

_JINJA_ENV = None


def _jinja_env():
    """A sandboxed jinja2 environment configured like HF transformers' chat-template renderer."""
    global _JINJA_ENV
    if _JINJA_ENV is not None:
        return _JINJA_ENV
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for HF's mask; render the body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _JINJA_ENV = env
    return env


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------

class StreamingDetokenizer:
    """Turns tokens into text one at a time; multi-byte UTF-8 characters split across tokens are
    held back until complete.

    ``add_token(id)`` feeds a token, ``last_segment`` returns the text that became complete since
    the previous read, ``text`` is all text so far, ``finalize()`` flushes a trailing incomplete
    sequence (as U+FFFD). ``tokens`` lists the ids fed.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: list[str] = []
        self._unread = 0  # index into _text of the first part not yet returned by last_segment
        self._first = True

    def add_token(self, token: int) -> None:
        self.tokens.append(int(token))
        piece = self._tok._piece(int(token), self._skip)
        if not piece:
            return
        if self._first:
            self._first = False
            if self._tok._strip_first_space and piece[:1] == b" ":
                piece = piece[1:]
        s = self._decoder.decode(piece, final=False)
        if s:
            self._text.append(s)

    def finalize(self) -> None:
        s = self._decoder.decode(b"", final=True)
        if s:
            self._text.append(s)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def last_segment(self) -> str:
        seg = "".join(self._text[self._unread:])
        self._unread = len(self._text)
        return seg


class Tokenizer:
    """Encode/decode text for one model; see :func:`load_gguf_tokenizer` and :func:`load_hf_tokenizer`."""

    def __init__(
        self,
        *,
        tokens: list[str],
        token_types: list[int],
        encoder,  # callable(str fragment, bool after_special) -> list[int]
        piece_of,  # callable(int id) -> bytes for a normal/byte token
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: set[int],
        add_bos: bool,
        add_eos: bool,
        chat_template: str | None,
        chat_templates: dict[str, str] | None = None,
        strip_first_space: bool = False,
        rstrip_ids: frozenset[int] = frozenset(),
        lstrip_ids: frozenset[int] = frozenset(),
        family: str = "",
        hf=None,
    ):
        self._tokens = tokens
        self._types = token_types
        self._encode_fragment = encoder
        self._piece_of = piece_of
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = set(eos_token_ids)
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self.chat_templates = dict(chat_templates or {})
        self._strip_first_space = strip_first_space
        self._rstrip = rstrip_ids
        self._lstrip = lstrip_ids
        self.family = family
        self._hf = hf
        self._token_to_id: dict[str, int] | None = None
        self._pieces: dict[int, bytes] = {}
        # Specials matched in text, longest first (llama.cpp: cache_special_tokens).
        special = [i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self._special_ids = special

    # ---- vocabulary ----
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def token_to_id(self, token: str) -> int | None:
        if self._token_to_id is None:
            self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        return self._token_to_id.get(token)

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control or unknown tokens: not rendered by decode(..., skip_special_tokens=True)."""
        return self._types[token_id] in (TOKEN_CONTROL, TOKEN_UNKNOWN)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self._tokens[self.eos_token_id]

    # ---- encoding ----
    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split text into raw fragments (str) and special token ids (int), llama.cpp-style:
        each special token, longest first, is cut out of the remaining raw fragments."""
        frags: list[str | int] = [text]
        for tid in self._special_ids:
            ttype = self._types[tid]
            if not parse_special and ttype != TOKEN_USER_DEFINED:
                continue
            tt = self._tokens[tid]
            if not tt:
                continue
            if not any(isinstance(f, str) and tt in f for f in frags):
                continue
            new: list[str | int] = []
            for f in frags:
                if not isinstance(f, str) or tt not in f:
                    new.append(f)
                    continue
                rest = f
                while True:
                    i = rest.find(tt)
                    if i < 0:
                        if rest:
                            new.append(rest)
                        break
                    left = rest[:i]
                    if tid in self._lstrip:
                        left = left.rstrip()
                    if left:
                        new.append(left)
                    new.append(tid)
                    rest = rest[i + len(tt):]
                    if tid in self._rstrip:
                        rest = rest.lstrip()
            frags = new
        return frags

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for ``text``. ``add_special_tokens`` adds BOS (and EOS) where the model asks
        for it; ``parse_special`` matches control tokens written in the text (user-defined tokens
        are always matched, as in llama.cpp)."""
        if self._hf is not None:
            return self._hf_encode(text, add_special_tokens, parse_special)
        out: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            out.append(self.bos_token_id)
        after_special = True
        if text:
            for frag in self._partition(text, parse_special):
                if isinstance(frag, int):
                    out.append(frag)
                    after_special = True
                else:
                    out.extend(self._encode_fragment(frag, after_special))
                    after_special = False
        if add_special_tokens and self.add_eos and self.eos_token_id is not None:
            out.append(self.eos_token_id)
        return out

    def _hf_encode(self, text: str, add_special_tokens: bool, parse_special: bool) -> list[int]:
        hf = self._hf
        hf.encode_special_tokens = not parse_special
        try:
            return hf.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            hf.encode_special_tokens = False

    def __call__(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens=add_special_tokens)

    # ---- decoding ----
    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        t = self._types[token_id] if 0 <= token_id < len(self._types) else TOKEN_UNUSED
        if t in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return b"" if skip_special else self._tokens[token_id].encode("utf-8")
        if t == TOKEN_USER_DEFINED:
            return self._tokens[token_id].encode("utf-8")
        if t not in (TOKEN_NORMAL, TOKEN_BYTE):
            return b""  # unused/undefined tokens render as nothing (llama.cpp)
        p = self._pieces.get(token_id)
        if p is None:
            p = self._piece_of(token_id)
            self._pieces[token_id] = p
        return p

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``. Control tokens are rendered as their text unless
        ``skip_special_tokens``. For SentencePiece-style vocabularies the space added before the
        first word at encode time is removed from the first token."""
        parts = []
        for i in ids:
            p = self._piece(int(i), skip_special_tokens)
            if not p:
                continue
            if not parts and self._strip_first_space and p[:1] == b" ":
                p = p[1:]
            parts.append(p)
        return b"".join(parts).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens)

    # ---- chat ----
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        """Render ``messages`` with the model's chat template (jinja2, as HF transformers does).

        Returns the prompt text; it already holds any BOS the template writes, so encode it with
        ``add_special_tokens=False``. ``chat_template`` may be a template or the name of one of
        ``self.chat_templates``."""
        import jinja2

        template = self.chat_template
        if chat_template is not None:
            template = self.chat_templates.get(chat_template, chat_template)
        if not template:
            raise MlxspecError(
                "the model has no chat template (tokenizer.chat_template); pass a prompt without --chat"
            )
        try:
            compiled = _compile_template(template)
            return compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise MlxspecError(f"chat template failed: {e}") from None

    # ---- export ----
    def save_hf(self, dir: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` (HF ``tokenizers``) and ``tokenizer_config.json`` into ``dir``.

        The files encode like this tokenizer (``transformers``/``mlx_lm.load`` read them):
        gpt2 BPE -> the BPE model with vocab and merges, the pre-tokenizer ``Split`` regexes
        followed by ``ByteLevel``, a ``ByteLevel`` decoder; llama SPM -> the score-ranked BPE
        model with byte fallback, normalizer ``Prepend("▁")`` (llama.cpp's space prefix at the
        start and after each special token) + ``Replace(" ", "▁")``, the SentencePiece decoder.
        Control / unknown tokens become special added tokens, user-defined tokens non-special
        added tokens (matched in raw text, as llama.cpp does); BOS/EOS insertion becomes a
        ``TemplateProcessing`` post-processor. The chat template, BOS and EOS go to
        tokenizer_config.json. Returns the directory."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, normalizers

        out = Path(dir)
        out.mkdir(parents=True, exist_ok=True)
        kind = self.family.split("/")[0]
        if self._hf is not None:  # came from a tokenizer.json: write it back as it is
            hf = HFTokenizer.from_str(self._hf.to_str())
        else:
            base = _closure_value(self._encode_fragment, "hf")
            if base is None or kind not in ("gpt2", "llama"):
                raise MlxspecError(
                    f"cannot write a tokenizer.json for the '{self.family}' vocabulary; "
                    "supported: gpt2 (byte-level BPE) and llama (SentencePiece BPE) vocabularies"
                )
            hf = HFTokenizer.from_str(base.to_str())  # a copy: the live one stays as it is
            if kind == "gpt2":
                hf.decoder = decoders.ByteLevel()
            else:
                steps = []
                if _closure_value(self._encode_fragment, "add_space_prefix"):
                    steps.append(normalizers.Prepend(_SPACE))
                steps.append(normalizers.Replace(" ", _SPACE))
                hf.normalizer = normalizers.Sequence(steps)
                dec = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                if self._strip_first_space:
                    dec.append(decoders.Strip(" ", 1, 0))
                hf.decoder = decoders.Sequence(dec)
            added = []
            for i, (t, ty) in enumerate(zip(self._tokens, self._types)):
                if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and self.token_to_id(t) == i:
                    added.append(AddedToken(t, special=ty != TOKEN_USER_DEFINED, normalized=False,
                                            lstrip=i in self._lstrip, rstrip=i in self._rstrip))
            hf.add_special_tokens([a for a in added if a.special])
            hf.add_tokens([a for a in added if not a.special])
            hf = _with_template_processing(hf, self)
        (out / "tokenizer.json").write_text(hf.to_str(pretty=True), encoding="utf-8")
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": bool(self.add_bos),
            "add_eos_token": bool(self.add_eos),
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        if self.bos_token is not None:
            cfg["bos_token"] = self.bos_token
        if self.eos_token is not None:
            cfg["eos_token"] = self.eos_token
        unk = next((t for t, ty in zip(self._tokens, self._types) if ty == TOKEN_UNKNOWN), None)
        if unk is not None:
            cfg["unk_token"] = unk
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8")
        return out


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compile_template(template: str):
    t = _TEMPLATE_CACHE.get(template)
    if t is None:
        t = _jinja_env().from_string(template)
        _TEMPLATE_CACHE[template] = t
    return t


def _with_template_processing(hf, tok: "Tokenizer"):
    """A copy of HF tokenizer ``hf`` whose post-processor adds ``tok``'s BOS/EOS as ``tok.encode`` does."""
    from tokenizers import Tokenizer as HFTokenizer

    single: list[dict] = []
    specials: dict[str, dict] = {}

    def special(t: str, i: int) -> dict:
        specials[t] = {"id": t, "ids": [i], "tokens": [t]}
        return {"SpecialToken": {"id": t, "type_id": 0}}

    if tok.add_bos and tok.bos_token_id is not None:
        single.append(special(tok.bos_token, tok.bos_token_id))
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    if tok.add_eos and tok.eos_token_id is not None:
        single.append(special(tok.eos_token, tok.eos_token_id))
    if not specials:
        return hf
    pair = single + [
        {"Sequence": {"id": "B", "type_id": 1}} if "Sequence" in p else {"SpecialToken": {**p["SpecialToken"], "type_id": 1}}
        for p in single
    ]
    raw = json.loads(hf.to_str())
    raw["post_processor"] = {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials}
    return HFTokenizer.from_str(json.dumps(raw))


def _closure_value(fn, name: str):
    """The value a closure (e.g. a Tokenizer's fragment encoder) captured under ``name``, or None."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return None
    for var, cell in zip(code.co_freevars, cells):
        if var == name:
            return cell.cell_contents
    return None


# --------------------------------------------------------------------------------------------
# GGUF -> Tokenizer
# --------------------------------------------------------------------------------------------

def _meta_int(md: dict, key: str) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        v = v.reshape(-1)[0]
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise MlxspecError(f"GGUF tokenizer metadata {key} is {str(v)[:40]!r} ({type(v).__name__}), expected an "
                           "integer; the file is corrupt")
    return int(v)


def _meta_bool(md: dict, key: str) -> bool | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        v = v.reshape(-1)[0]
    if not isinstance(v, (bool, np.bool_)):
        raise MlxspecError(f"GGUF tokenizer metadata {key} is {str(v)[:40]!r} ({type(v).__name__}), expected true or "
                           "false; the file is corrupt")
    return bool(v)


def _meta_str(md: dict, key: str) -> str | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).decode("utf-8", errors="replace")
    if not isinstance(v, str):
        raise MlxspecError(f"GGUF metadata {key} is {str(v)[:40]!r} ({type(v).__name__}), expected a string; "
                           "the file is corrupt")
    return v


def load_gguf_tokenizer(metadata: dict) -> Tokenizer:
    """Build a :class:`Tokenizer` from GGUF metadata (key -> python value; arrays may be lists or
    numpy arrays), e.g. from :func:`read_gguf_metadata`. Raises MlxspecError for vocabularies this
    module does not handle."""
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    md = metadata
    model = _meta_str(md, "tokenizer.ggml.model")
    if model is None:
        raise MlxspecError("the GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in SUPPORTED_MODELS:
        why = REFUSED_MODELS.get(model, "unknown tokenizer model")
        raise MlxspecError(
            f"tokenizer.ggml.model '{model}' is not supported ({why}); supported: {', '.join(SUPPORTED_MODELS)}"
        )
    if not isinstance(md.get("tokenizer.ggml.tokens", []), (list, tuple, np.ndarray)):
        raise MlxspecError("tokenizer.ggml.tokens is not a list of strings; the file is corrupt")
    tokens = _as_list(md.get("tokenizer.ggml.tokens"))
    if not tokens:
        raise MlxspecError("the GGUF metadata has no token list (tokenizer.ggml.tokens)")
    if not all(isinstance(t, str) for t in tokens):
        raise MlxspecError("tokenizer.ggml.tokens holds non-string entries; the file is corrupt")
    n = len(tokens)
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[EMPTY_{i}]"  # as llama.cpp
    types = md.get("tokenizer.ggml.token_type")
    types = [TOKEN_NORMAL] * n if types is None else _as_list(types)[:n]
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x <= 7 for x in types):
        raise MlxspecError("tokenizer.ggml.token_type holds entries that are not token types (integers 0..7); "
                           "the file is corrupt")
    if len(types) < n:
        raise MlxspecError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; the file is corrupt")
    pre_name = _meta_str(md, "tokenizer.ggml.pre")

    # vocab: llama.cpp's token_to_id keeps the last id of a duplicated text
    vocab = {t: i for i, t in enumerate(tokens)}

    add_space_prefix = False
    escape_ws = False
    byte_encode = True
    pre: _Pre | None = None
    ignore_merges = False
    add_bos = False
    bos_default: int | None = None
    eos_default: int | None = None
    unk_default: int | None = None

    if model == "gpt2":
        name = pre_name or "default"
        pre = BPE_PRE_TOKENIZERS.get(name)
        if pre is None:
            raise MlxspecError(
                f"unknown pre-tokenizer tokenizer.ggml.pre='{name}' for a gpt2 (BPE) vocabulary; "
                f"supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))}"
            )
        ignore_merges, add_bos = pre.ignore_merges, pre.add_bos
        family = f"gpt2/{name}"
    elif model == "gemma4":
        escape_ws, byte_encode, add_bos = True, False, True
        family = "gemma4"
    else:  # llama (SentencePiece BPE)
        add_space_prefix, add_bos = True, True
        bos_default, eos_default, unk_default = 1, 2, 0
        family = "llama"
    v = _meta_bool(md, "tokenizer.ggml.add_space_prefix")
    if v is not None:
        add_space_prefix = v
    v = _meta_bool(md, "tokenizer.ggml.add_bos_token")
    if v is not None:
        add_bos = v
    if model == "gemma4":
        add_bos = True  # llama.cpp forces it for Gemma 4
    add_eos = bool(_meta_bool(md, "tokenizer.ggml.add_eos_token") or False)
    # tokenizer.ggml.remove_extra_whitespaces only affects Unigram (t5) vocabularies in llama.cpp.

    def special_id(key: str, default: int | None) -> int | None:
        v = _meta_int(md, key)
        if v is not None and 0 <= v < n:
            return v
        return default if default is not None and 0 <= default < n else None

    bos = special_id("tokenizer.ggml.bos_token_id", bos_default)
    if pre is not None and pre.no_bos:
        bos = None
    eos = special_id("tokenizer.ggml.eos_token_id", eos_default)
    eot = special_id("tokenizer.ggml.eot_token_id", None)
    eom = special_id("tokenizer.ggml.eom_token_id", None)
    unk = special_id("tokenizer.ggml.unknown_token_id", unk_default)

    # ---- the HF model that tokenizes raw text fragments ----
    if model == "llama":
        scores = md.get("tokenizer.ggml.scores")
        scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, dtype=np.float32)[:n]
        merges = _spm_merges(tokens, scores, vocab)
        hf_model = models.BPE(
            vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False,
            unk_token=tokens[unk] if unk is not None else None,
        )
        hf = HFTokenizer(hf_model)
    else:
        raw_merges = _as_list(md.get("tokenizer.ggml.merges"))
        if not raw_merges:
            raise MlxspecError(f"tokenizer.ggml.model '{model}' needs tokenizer.ggml.merges, which is missing")
        merges = []
        for m in raw_merges:
            if not isinstance(m, str):
                raise MlxspecError("tokenizer.ggml.merges holds non-string entries; the file is corrupt")
            p = m.find(" ", 1)
            if p > 0:
                merges.append((m[:p], m[p + 1:]))
        try:
            hf_model = models.BPE(
                vocab=vocab, merges=merges, ignore_merges=ignore_merges, byte_fallback=not byte_encode,
            )
        except Exception as e:  # the tokenizers library's own error, e.g. a merge of unknown tokens
            raise MlxspecError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                               f"({str(e).splitlines()[0][:100]}); the file is corrupt") from None
        hf = HFTokenizer(hf_model)
        if pre is not None:
            steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
            hf.pre_tokenizer = pre_tokenizers.Sequence(steps)

    if model == "llama":
        def encode_fragment(text: str, after_special: bool) -> list[int]:
            if add_space_prefix and after_special:
                text = " " + text
            return hf.encode(text.replace(" ", _SPACE), add_special_tokens=False).ids
    elif model == "gemma4":
        def encode_fragment(text: str, after_special: bool) -> list[int]:
            text = text.replace(" ", _SPACE)
            out: list[int] = []
            # llama.cpp splits on newline runs; a newline run that is a token is taken whole
            for piece in _newline_runs(text):
                if piece[0] == "\n" and piece in vocab:
                    out.append(vocab[piece])
                else:
                    out.extend(hf.encode(piece, add_special_tokens=False).ids)
            return out
    else:
        def encode_fragment(text: str, after_special: bool) -> list[int]:
            return hf.encode(text, add_special_tokens=False).ids

    # ---- decoding pieces ----
    if byte_encode and model == "gpt2":
        def piece_of(i: int) -> bytes:
            if types[i] == TOKEN_BYTE:
                b = _parse_byte_token(tokens[i])
                if b is not None:
                    return bytes([b])
            return _byte_level_decode(tokens[i])
    else:
        def piece_of(i: int) -> bytes:
            t = tokens[i]
            if types[i] == TOKEN_BYTE:
                b = _parse_byte_token(t)
                if b is not None:
                    return bytes([b])
            return t.replace(_SPACE, " ").encode("utf-8")

    # ---- end of generation ----
    eog: set[int] = {i for i in (eos, eot, eom) if i is not None}
    for text in EOG_TEXTS:
        i = vocab.get(text)
        if i is not None and not (text == "</s>" and types[i] == TOKEN_NORMAL):
            eog.add(i)
    chat_template = _meta_str(md, "tokenizer.chat_template")
    names = _as_list(md.get("tokenizer.chat_templates"))
    chat_templates = {}
    for nm in names:
        t = _meta_str(md, f"tokenizer.chat_template.{nm}")
        if t:
            chat_templates[str(nm)] = t
    if chat_template and "<|im_end|>" in chat_template and "<|im_end|>" in vocab:
        eog.add(vocab["<|im_end|>"])

    # ---- per-token strip attributes llama.cpp sets by model name (phi-3) ----
    rstrip: set[int] = set()
    general_name = (_meta_str(md, "general.name") or "").lower()
    if model == "llama" and ("phi-3" in general_name or "phi3" in general_name):
        rstrip = {i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)}
        for t in ("</s>",):
            if t in vocab:
                rstrip.add(vocab[t])
        for t in ("<unk>", "<s>", "<|endoftext|>"):
            rstrip.discard(vocab.get(t, -1))

    return Tokenizer(
        tokens=tokens,
        token_types=types,
        encoder=encode_fragment,
        piece_of=piece_of,
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=eog,
        add_bos=add_bos and bos is not None,
        add_eos=add_eos and eos is not None,
        chat_template=chat_template,
        chat_templates=chat_templates,
        strip_first_space=(model == "llama" and add_space_prefix),
        rstrip_ids=frozenset(rstrip),
        family=family,
    )


def _newline_runs(text: str) -> list[str]:
    out = []
    i, n = 0, len(text)
    while i < n:
        j = i
        nl = text[i] == "\n"
        while j < n and (text[j] == "\n") == nl:
            j += 1
        out.append(text[i:j])
        i = j
    return out


def _spm_merges(tokens: list[str], scores: np.ndarray, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Merges equivalent to SentencePiece/llama.cpp score-driven BPE: every split of a token into
    two tokens is a merge, ranked by the merged token's score (highest first)."""
    found: list[tuple[float, int, str, str]] = []
    for i, t in enumerate(tokens):
        if len(t) < 2:
            continue
        s = float(scores[i])
        for k in range(1, len(t)):
            a = t[:k]
            if a in vocab:
                b = t[k:]
                if b in vocab:
                    found.append((-s, i, a, b))
    found.sort()
    return [(a, b) for _, _, a, b in found]


# --------------------------------------------------------------------------------------------
# tokenizer.json -> Tokenizer
# --------------------------------------------------------------------------------------------

def _token_content(x) -> str | None:
    if x is None:
        return None
    if isinstance(x, dict):
        return x.get("content")
    return str(x)


def load_hf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Build a :class:`Tokenizer` from a HuggingFace model directory (tokenizer.json, plus
    tokenizer_config.json for the chat template, BOS and EOS) or a tokenizer.json file."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    d = path if path.is_dir() else path.parent
    tj = path if path.is_file() else d / "tokenizer.json"
    if not tj.is_file():
        raise MlxspecError(f"{d}: no tokenizer.json; pass a model directory that has one")
    try:
        raw = json.loads(tj.read_text(encoding="utf-8"))
        hf = HFTokenizer.from_str(json.dumps(raw))
    except Exception as e:
        raise MlxspecError(f"{tj}: cannot read tokenizer.json ({e})") from None
    cfg: dict = {}
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except Exception as e:
            raise MlxspecError(f"{cfg_path}: invalid JSON ({e})") from None

    n = hf.get_vocab_size(with_added_tokens=True)
    vocab = hf.get_vocab(with_added_tokens=True)
    n = max(n, max(vocab.values()) + 1 if vocab else 0)
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = [TOKEN_NORMAL] * n
    for i, t in enumerate(tokens):
        if _parse_byte_token(t) is not None:
            types[i] = TOKEN_BYTE
    for i, at in hf.get_added_tokens_decoder().items():
        types[i] = TOKEN_CONTROL if at.special else TOKEN_USER_DEFINED

    # how token strings map to bytes, from the decoder
    dec_types: set = set()
    strip_first = False

    def walk(x):
        nonlocal strip_first
        if isinstance(x, dict):
            dec_types.add(x.get("type"))
            if x.get("type") == "Metaspace" and x.get("prepend_scheme", "always") != "never":
                strip_first = x.get("add_prefix_space", True)
            if x.get("type") == "Strip" and x.get("content") == " " and x.get("start", 0) >= 1:
                strip_first = True
            for sub in x.get("decoders") or []:
                walk(sub)

    walk(raw.get("decoder") or {})
    byte_level = "ByteLevel" in dec_types
    sp_style = bool(dec_types & {"Metaspace", "ByteFallback", "Replace"})
    if byte_level:
        def piece_of(i: int) -> bytes:
            return _byte_level_decode(tokens[i])
    elif sp_style:
        def piece_of(i: int) -> bytes:
            b = _parse_byte_token(tokens[i])
            if b is not None and types[i] == TOKEN_BYTE:
                return bytes([b])
            return tokens[i].replace(_SPACE, " ").encode("utf-8")
    else:
        def piece_of(i: int) -> bytes:
            return hf.decode([i], skip_special_tokens=False).encode("utf-8")

    bos_t = _token_content(cfg.get("bos_token"))
    eos_t = _token_content(cfg.get("eos_token"))
    bos = vocab.get(bos_t) if bos_t else None
    eos = vocab.get(eos_t) if eos_t else None
    eog = {i for i in (eos,) if i is not None}
    template = cfg.get("chat_template")
    templates: dict[str, str] = {}
    if isinstance(template, list):  # [{"name":..., "template":...}]
        templates = {x["name"]: x["template"] for x in template if isinstance(x, dict)}
        template = templates.get("default")
    jinja = d / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    if template and "<|im_end|>" in template and "<|im_end|>" in vocab:
        eog.add(vocab["<|im_end|>"])
    # generation_config.json may list more end ids
    gen = d / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            eog.update(int(x) for x in (g if isinstance(g, list) else [g]) if x is not None)
        except Exception:
            pass

    tok = Tokenizer(
        tokens=tokens,
        token_types=types,
        encoder=None,
        piece_of=piece_of,
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=eog,
        add_bos=bool(cfg.get("add_bos_token", False)),
        add_eos=bool(cfg.get("add_eos_token", False)),
        chat_template=template,
        chat_templates=templates,
        strip_first_space=strip_first,
        family="hf",
        hf=hf,
    )
    return tok

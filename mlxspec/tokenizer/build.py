"""Tokenizers for mlxspec: mlx-lm ``TokenizerWrapper`` objects built from GGUF metadata or loaded
from a HuggingFace/MLX model directory.

``load_gguf_tokenizer(metadata)`` builds a HuggingFace ``tokenizers.Tokenizer`` that tokenizes as
llama.cpp does (``src/llama-vocab.cpp``):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE with merges; the text is split with the
  pre-tokenizer regexes that ``tokenizer.ggml.pre`` names (see ``pretokenizers.py``), applied one
  after the other as llama.cpp does (matches and the gaps between them both become pieces).
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE on scores (every split of a token into
  two tokens is a merge ranked by the token's score) with byte fallback, spaces escaped as U+2581 and
  a space prepended to each text fragment that starts the text or follows a special token.
* ``tokenizer.ggml.model == "gemma4"``: SentencePiece-style BPE with merges (raw UTF-8, byte
  fallback), newline runs split from the rest of the text.

Control (type 3) and unknown (type 2) tokens become special added tokens, user-defined (type 4)
tokens non-special added tokens, so that with ``split_special_tokens=True`` only user-defined tokens
are matched in the text (llama.cpp's ``parse_special=false``). The result is wrapped as a
``transformers.PreTrainedTokenizerFast`` (BOS/EOS, chat template; ``save_pretrained`` writes a
directory mlx-lm and transformers load) inside an mlx-lm ``TokenizerWrapper`` whose
``eos_token_ids`` follow llama.cpp's end-of-generation rules.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import jinja2
import numpy as np
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from mlx_lm.tokenizer_utils import load as mlx_lm_load_tokenizer
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from mlxspec.errors import MlxspecError
from mlxspec.tokenizer.pretokenizers import (
    BPE_PRE_TOKENIZERS,
    REFUSED_MODELS,
    SUPPORTED_MODELS,
    _Pre,
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

_SPACE = "\u2581"


class ByteLevelDetokenizer(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE streaming detokenizer, keeping a leading space of the text (as
    ``decode`` and llama.cpp do) instead of trimming it."""

    def _maybe_trim_space(self, current_text):
        return current_text


class SentencePieceDetokenizer(SPMStreamingDetokenizer):
    """mlx-lm's SentencePiece streaming detokenizer, trimming the prefix space from the first piece
    of text only (as ``decode`` does), not from each piece until some text has come out."""

    def __init__(self, tokenizer, trim_space=True):
        self._trim_first = trim_space
        super().__init__(tokenizer, trim_space)

    def reset(self):
        super().reset()
        self.trim_space = self._trim_first

    def _try_flush(self, force=False):
        pending = self._unflushed
        super()._try_flush(force)
        if pending and not self._unflushed:
            self.trim_space = False


# --------------------------------------------------------------------------------------------
# GGUF metadata values
# --------------------------------------------------------------------------------------------

def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, np.ndarray):
        return x.tolist()
    return list(x)


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


def _checked_model(md: dict) -> str:
    model = _meta_str(md, "tokenizer.ggml.model")
    if model is None:
        raise MlxspecError("the GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in SUPPORTED_MODELS:
        why = REFUSED_MODELS.get(model, "unknown tokenizer model")
        raise MlxspecError(
            f"tokenizer.ggml.model '{model}' is not supported ({why}); supported: {', '.join(SUPPORTED_MODELS)}"
        )
    return model


def _bpe_pre(md: dict) -> tuple[str, _Pre]:
    name = _meta_str(md, "tokenizer.ggml.pre") or "default"
    pre = BPE_PRE_TOKENIZERS.get(name)
    if pre is None:
        raise MlxspecError(
            f"unknown pre-tokenizer tokenizer.ggml.pre='{name}' for a gpt2 (BPE) vocabulary; "
            f"supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))}"
        )
    return name, pre


def tokenizer_family(metadata: dict) -> str:
    """The tokenizer kind GGUF ``metadata`` holds: ``gpt2/<pre-tokenizer>``, ``llama`` or ``gemma4``."""
    model = _checked_model(metadata)
    return f"gpt2/{_bpe_pre(metadata)[0]}" if model == "gpt2" else model


# --------------------------------------------------------------------------------------------
# GGUF -> tokenizer
# --------------------------------------------------------------------------------------------

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


def _gguf_merges(md: dict, model: str) -> list[tuple[str, str]]:
    raw = _as_list(md.get("tokenizer.ggml.merges"))
    if not raw:
        raise MlxspecError(f"tokenizer.ggml.model '{model}' needs tokenizer.ggml.merges, which is missing")
    merges = []
    for m in raw:
        if not isinstance(m, str):
            raise MlxspecError("tokenizer.ggml.merges holds non-string entries; the file is corrupt")
        p = m.find(" ", 1)
        if p > 0:
            merges.append((m[:p], m[p + 1:]))
    return merges


def load_gguf_tokenizer(metadata: dict) -> TokenizerWrapper:
    """Build the tokenizer GGUF ``metadata`` describes (key -> python value; arrays may be lists or
    numpy arrays, e.g. ``read_gguf(path).metadata``). Raises MlxspecError for vocabularies it does
    not handle."""
    md = metadata
    model = _checked_model(md)
    if not isinstance(md.get("tokenizer.ggml.tokens", []), (list, tuple, np.ndarray)):
        raise MlxspecError("tokenizer.ggml.tokens is not a list of strings; the file is corrupt")
    tokens = _as_list(md.get("tokenizer.ggml.tokens"))
    if not tokens:
        raise MlxspecError("the GGUF metadata has no token list (tokenizer.ggml.tokens)")
    if not all(isinstance(t, str) for t in tokens):
        raise MlxspecError("tokenizer.ggml.tokens holds non-string entries; the file is corrupt")
    n = len(tokens)
    types = md.get("tokenizer.ggml.token_type")
    types = [TOKEN_NORMAL] * n if types is None else _as_list(types)[:n]
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x <= 7 for x in types):
        raise MlxspecError("tokenizer.ggml.token_type holds entries that are not token types (integers 0..7); "
                           "the file is corrupt")
    if len(types) < n:
        raise MlxspecError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; the file is corrupt")
    # llama.cpp names empty tokens [EMPTY_<id>]; a repeated text keeps its last id for encoding,
    # the earlier ids get a name of their own so that every id has one
    last = {t: i for i, t in enumerate(tokens)}
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[EMPTY_{i}]"
        elif last[t] != i:
            tokens[i] = f"[DUPLICATE_{i}]"
    vocab = {t: i for i, t in enumerate(tokens)}

    pre: _Pre | None = None
    add_space_prefix = add_bos = False
    bos_default = eos_default = unk_default = None
    if model == "gpt2":
        pre = _bpe_pre(md)[1]
        add_bos = pre.add_bos
    elif model == "gemma4":
        add_bos = True
    else:  # llama (SentencePiece BPE)
        add_space_prefix, add_bos = True, True
        bos_default, eos_default, unk_default = 1, 2, 0
    v = _meta_bool(md, "tokenizer.ggml.add_space_prefix")
    if v is not None:
        add_space_prefix = v
    v = _meta_bool(md, "tokenizer.ggml.add_bos_token")
    if v is not None and model != "gemma4":  # llama.cpp forces BOS for Gemma 4
        add_bos = v
    add_eos = bool(_meta_bool(md, "tokenizer.ggml.add_eos_token") or False)
    # tokenizer.ggml.remove_extra_whitespaces only affects Unigram (t5) vocabularies in llama.cpp.

    def special_id(key: str, default: int | None) -> int | None:
        v = _meta_int(md, key)
        if v is not None and 0 <= v < n:
            return v
        return default if default is not None and 0 <= default < n else None

    bos = None if pre is not None and pre.no_bos else special_id("tokenizer.ggml.bos_token_id", bos_default)
    eos = special_id("tokenizer.ggml.eos_token_id", eos_default)
    eot = special_id("tokenizer.ggml.eot_token_id", None)
    eom = special_id("tokenizer.ggml.eom_token_id", None)
    unk = special_id("tokenizer.ggml.unknown_token_id", unk_default)

    # ---- the tokenizers.Tokenizer ----
    if model == "llama":
        scores = md.get("tokenizer.ggml.scores")
        scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, dtype=np.float32)[:n]
        hf = HFTokenizer(models.BPE(
            vocab=vocab, merges=_spm_merges(tokens, scores, vocab), byte_fallback=True, fuse_unk=False,
            unk_token=tokens[unk] if unk is not None else None,
        ))
        steps = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
        hf.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", _SPACE)])
        dec = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        hf.decoder = decoders.Sequence(dec)
        detokenizer = partial(SentencePieceDetokenizer, trim_space=add_space_prefix)
    else:
        merges = _gguf_merges(md, model)
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=model == "gemma4",
                             ignore_merges=pre is not None and pre.ignore_merges)
        except Exception as e:  # noqa: BLE001 - the tokenizers library's own error, e.g. a merge of unknown tokens
            raise MlxspecError(f"tokenizer.ggml.merges do not fit tokenizer.ggml.tokens "
                               f"({str(e).splitlines()[0][:100]}); the file is corrupt") from None
        hf = HFTokenizer(bpe)
        if model == "gemma4":
            hf.normalizer = normalizers.Replace(" ", _SPACE)
            hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated")
            hf.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
            detokenizer = partial(SPMStreamingDetokenizer, trim_space=False)
        else:
            steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
            hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
            hf.decoder = decoders.ByteLevel()
            detokenizer = ByteLevelDetokenizer

    # ---- special tokens, matched in the text before the rest is tokenized ----
    # phi-3: llama.cpp strips the spaces after its control tokens (set by model name)
    general_name = (_meta_str(md, "general.name") or "").lower()
    rstrip: set[int] = set()
    if model == "llama" and ("phi-3" in general_name or "phi3" in general_name):
        rstrip = {i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)}
        rstrip.add(vocab.get("</s>", -1))
        rstrip -= {vocab.get(t, -1) for t in ("<unk>", "<s>", "<|endoftext|>")}
    added = [AddedToken(t, special=ty != TOKEN_USER_DEFINED, normalized=False, rstrip=i in rstrip)
             for i, (t, ty) in enumerate(zip(tokens, types))
             if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
    hf.add_special_tokens([a for a in added if a.special])
    hf.add_tokens([a for a in added if not a.special])

    # ---- chat templates and end of generation ----
    chat_template = _meta_str(md, "tokenizer.chat_template")
    eog = {i for i in (eos, eot, eom) if i is not None}
    for text in EOG_TEXTS:
        i = vocab.get(text)
        if i is not None and not (text == "</s>" and types[i] == TOKEN_NORMAL):
            eog.add(i)
    if chat_template and "<|im_end|>" in chat_template and "<|im_end|>" in vocab:
        eog.add(vocab["<|im_end|>"])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=hf,
        bos_token=tokens[bos] if bos is not None else None,
        eos_token=tokens[eos] if eos is not None else None,
        unk_token=tokens[unk] if unk is not None and types[unk] == TOKEN_UNKNOWN else None,
        add_bos_token=add_bos and bos is not None,
        add_eos_token=add_eos and eos is not None,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    return TokenizerWrapper(fast, detokenizer, eos_token_ids=eog)


# --------------------------------------------------------------------------------------------
# Model directories
# --------------------------------------------------------------------------------------------

def load_hf_tokenizer(path: str | os.PathLike) -> TokenizerWrapper:
    """The tokenizer of a HuggingFace/MLX model directory (tokenizer.json, tokenizer_config.json),
    loaded by mlx-lm, with the streaming detokenizers that keep a leading space as ``decode`` does.
    End of generation also stops at ``<|im_end|>`` when the chat template writes
    it and at the ids generation_config.json lists."""
    path = Path(path)
    d = path if path.is_dir() else path.parent
    tj = path if path.is_file() else d / "tokenizer.json"
    if not tj.is_file():
        raise MlxspecError(f"{d}: no tokenizer.json; pass a model directory that has one")
    cfg_path = d / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            json.loads(cfg_path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise MlxspecError(f"{cfg_path}: invalid JSON ({e})") from None
    try:
        if cfg_path.is_file():
            tok = mlx_lm_load_tokenizer(d)
        else:
            # no tokenizer_config.json: transformers would pick a tokenizer class from
            # config.json's model_type, which need not be the one tokenizer.json describes
            tok = TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_file=str(tj)), NaiveStreamingDetokenizer)
    except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many kinds for a bad file
        raise MlxspecError(f"{tj}: cannot read tokenizer.json ({e})") from None
    det = tok.detokenizer
    if type(det) is BPEStreamingDetokenizer:
        tok._detokenizer = ByteLevelDetokenizer(tok._tokenizer)
    elif type(det) is SPMStreamingDetokenizer and det.trim_space:
        tok._detokenizer = SentencePieceDetokenizer(tok._tokenizer)
    template = tok.chat_template
    im_end = tok.get_vocab().get("<|im_end|>")
    if isinstance(template, str) and "<|im_end|>" in template and im_end is not None:
        tok.add_eos_token(im_end)
    gen = d / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            for x in g if isinstance(g, list) else [g]:
                if x is not None:
                    tok.add_eos_token(int(x))
        except (ValueError, TypeError, AttributeError, OSError):  # an unreadable file adds no ids
            pass
    return tok


# --------------------------------------------------------------------------------------------
# Chat prompts
# --------------------------------------------------------------------------------------------

def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list | None = None, chat_template: str | None = None, **kwargs) -> str:
    """Render ``messages`` (as given) with the tokenizer's chat template or ``chat_template``, as text,
    by transformers' template renderer; template errors become MlxspecError.

    The text already holds any BOS the template writes, so encode it with ``add_special_tokens=False``."""
    hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
    template = chat_template or hf.chat_template
    if not template:
        raise MlxspecError(
            "the model has no chat template (tokenizer.chat_template); pass a prompt without --chat"
        )
    try:
        rendered, _ = render_jinja_template([messages], tools=tools, chat_template=template,
                                            add_generation_prompt=add_generation_prompt,
                                            **{**hf.special_tokens_map, **kwargs})
    except jinja2.TemplateError as e:
        raise MlxspecError(f"chat template failed: {e}") from None
    return rendered[0]

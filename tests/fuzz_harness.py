"""mlxspec's own fuzz suite: seeded hostile inputs, each run under a time limit and a memory cap.

Every case must end in one of two ways:
  - "error": the CLI exits 2 printing exactly one line `mlxspec: error: ...` (the API raises
    `MlxspecError`, a ValueError), no traceback;
  - "same":  a normal run whose output equals the uncorrupted baseline ("ok" for a valid
    flag value, which has no baseline of its own).
Anything else is a failure: traceback, crash (signal), hang (time limit), oom (memory cap),
wrong (output differs from the baseline without a word), accepted (an out-of-range flag ran),
refused (a valid flag value was refused), bad-error (an error that is not one line / exit 2),
misleading (an error that does not name the cause the case names, `Case.mention`).

Mutations are built with real writers (the `gguf` package's GGUFWriter, `safetensors`, `json`)
from a tiny llama target (tests/conftest.py's tiny model, 2 layers, vocabulary 261) and a
tiny DSpark drafter for it (speculators directory and GGUF). Raw byte edits (flips, truncation,
table patches) are made on the writer's output at structural positions found by an
independent GGUF walker; tensor data is never touched (GGUF has no checksum, so a data edit
can legitimately pass unnoticed).

Cases run in a worker process (one import of mlx for many cases) with RLIMIT_AS as the memory
cap and a per-case wall-clock limit; a worker that dies or hangs is replaced, and the case is
recorded as crash / hang / oom.

Used by tests/test_fuzz.py (a few hundred cases) and scripts/fuzz.py (--cases N --seed S).
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOOD = ("error", "same", "ok")
PROMPT = "the the hello"
MAX_TOKENS = "6"
MEM_CAP = 6 << 30
CASE_LIMIT_S = 60.0


@dataclass
class Case:
    id: str
    group: str  # gguf-target | gguf-drafter | hf-drafter | safetensors | flags | api | files
    desc: str
    argv: list = field(default_factory=list)  # mlxspec CLI arguments (generate ...)
    stdin: bytes | None = None
    expect: str = "same"  # "same": error or baseline output; "error": must be refused; "ok": must run
    api: dict | None = None  # {"kwargs": {...}} for an API call on the baseline target
    build: object = None  # callable(dir) -> dict of path substitutions, run in the parent before the case
    mention: str | None = None  # an error must name this (the real cause), else "misleading"


# ============================================================================ GGUF building

def _conftest():
    sys.path.insert(0, HERE)
    import conftest  # noqa: E402

    return conftest


U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = 4, 5, 6, 7, 8, 9, 10, 11, 12


def target_spec():
    """(metadata [(key, vtype, value, subtype)], tensors {name: (array, type)}) of the baseline target."""
    import gguf

    c = _conftest()
    t = c.TINY
    md = [
        ("llama.block_count", U32, t["layers"], None),
        ("llama.context_length", U32, 512, None),
        ("llama.embedding_length", U32, t["hidden"], None),
        ("llama.feed_forward_length", U32, t["ffn"], None),
        ("llama.attention.head_count", U32, t["heads"], None),
        ("llama.attention.head_count_kv", U32, t["kv_heads"], None),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5, None),
        ("llama.rope.freq_base", F32, 10000.0, None),
    ]
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_end|>"]
    md += [
        ("tokenizer.ggml.model", STR, "gpt2", None),
        ("tokenizer.ggml.pre", STR, "gpt-2", None),
        ("tokenizer.ggml.tokens", ARR, tokens, STR),
        ("tokenizer.ggml.token_type", ARR, [1] * (len(tokens) - 2) + [3, 3], I32),
        ("tokenizer.ggml.merges", ARR, ["Ġ t", "h e", "Ġt he"], STR),
        ("tokenizer.ggml.bos_token_id", U32, len(tokens) - 2, None),
        ("tokenizer.ggml.eos_token_id", U32, len(tokens) - 1, None),
        ("tokenizer.ggml.add_bos_token", BOOL, False, None),
    ]
    tensors = {}
    for name, a in c.tiny_tensors(seed=0).items():
        if ".attn_q." in name:
            a = c.llama_cpp_permute(a, t["heads"])
        elif ".attn_k." in name:
            a = c.llama_cpp_permute(a, t["kv_heads"])
        kind = "F16" if a.ndim == 2 else "F32"
        tensors[name] = (a.astype(np.float16) if kind == "F16" else a.astype(np.float32), kind)
    del gguf
    return md, tensors


def write_gguf_file(path, arch, md, tensors, alignment=None):
    """Write with GGUFWriter; md values typed explicitly (wrong types are the point)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.data_alignment = alignment
    for key, vt, val, sub in md:
        w.add_key_value(key, val, gguf.GGUFValueType(vt), sub_type=None if sub is None else gguf.GGUFValueType(sub))
    for name, (a, kind) in tensors.items():
        if kind in ("F32", "F16", "I32"):
            w.add_tensor(name, a)
        else:
            qt = gguf.GGMLQuantizationType[kind]
            raw = gguf.quants.quantize(a.astype(np.float32), qt)
            w.add_tensor(name, raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def walk_gguf(data: bytes) -> tuple[list, int]:
    """Independent GGUF walker -> ([(kind, start, length, label)], data_start). Structure only."""
    out, pos = [], 0

    def take(kind, n, label=""):
        nonlocal pos
        out.append((kind, pos, n, label))
        pos += n
        return data[pos - n:pos]

    take("magic", 4)
    take("version", 4)
    n_t = struct.unpack("<Q", take("n_tensors", 8))[0]
    n_kv = struct.unpack("<Q", take("n_kv", 8))[0]
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(kind_len, kind_data, label=""):
        n = struct.unpack("<Q", take(kind_len, 8, label))[0]
        return take(kind_data, n, label)

    def value(vt, label):
        if vt in sizes:
            take("value", sizes[vt], label)
        elif vt == 8:
            string("str_len", "str_data", label)
        elif vt == 9:
            et = struct.unpack("<I", take("arr_type", 4, label))[0]
            n = struct.unpack("<Q", take("arr_count", 8, label))[0]
            if et in sizes:
                take("arr_data", sizes[et] * n, label)
            else:
                for _ in range(n):
                    value(et, label)

    for _ in range(n_kv):
        key = string("key_len", "key", "").decode()
        out[-1] = (out[-1][0], out[-1][1], out[-1][2], key)
        out[-2] = (out[-2][0], out[-2][1], out[-2][2], key)
        vt = struct.unpack("<I", take("vtype", 4, key))[0]
        value(vt, key)
    for _ in range(n_t):
        name = string("t_name_len", "t_name").decode()
        nd = struct.unpack("<I", take("t_ndims", 4, name))[0]
        for _ in range(nd):
            take("t_dim", 8, name)
        take("t_type", 4, name)
        take("t_offset", 8, name)
    return out, pos


# Structural fields whose bytes may be flipped: any change must be refused or harmless.
# Value payloads (numbers, strings, token lists) are excluded: a different in-range value is a
# different valid file. Key names are flipped only for model hyper-parameters.
FLIPPABLE = ("magic", "version", "n_tensors", "n_kv", "key_len", "vtype", "str_len", "arr_type", "arr_count",
             "t_name_len", "t_name", "t_ndims", "t_dim", "t_type", "t_offset")


# ============================================================================ fixtures

class Fixtures:
    """Baseline files in `root`: target.gguf, drafter (speculators dir), drafter.gguf."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.target = os.path.join(root, "target.gguf")
        self.md, self.tensors = target_spec()
        write_gguf_file(self.target, "llama", self.md, self.tensors)
        self.target_bytes = open(self.target, "rb").read()
        self.layout, self.data_start = walk_gguf(self.target_bytes)
        self.drafter = os.path.join(root, "drafter")
        self.drafter_gguf = os.path.join(root, "drafter.gguf")
        self._write_drafters()
        self.hf_target = os.path.join(root, "target-mlx")
        from mlxspec.targets.convert import convert_to_mlx

        convert_to_mlx(self.target, self.hf_target, dtype="float32")
        self.dg_bytes = open(self.drafter_gguf, "rb").read()
        import gguf

        self.dg_types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(self.drafter_gguf).tensors}
        self.dg_layout, self.dg_data_start = walk_gguf(self.dg_bytes)

    def _write_drafters(self):
        import mlx.core as mx
        from mlx.utils import tree_unflatten

        from mlxspec.drafters.common import model_tensors
        from mlxspec.drafters.config import DrafterConfig
        from mlxspec.drafters.load import save_drafter
        from mlxspec.drafters.model import DFlashModel

        c = _conftest()
        t = c.TINY
        cfg = DrafterConfig(hidden_size=t["hidden"], intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, block_size=4,
                            target_layer_ids=[0], mask_token_id=t["vocab"] - 2, vocab_size=t["vocab"], rope_theta=10000.0,
                            markov_rank=4, confidence_head=True, draft_vocab_size=64, has_lm_head=False,
                            sample_from_anchor=True)
        mx.random.seed(3)
        m = DFlashModel(cfg)
        new = {k: mx.random.normal(v.shape) * 0.05 + (1.0 if k.endswith("norm.weight") else 0.0)
               for k, v in model_tensors(m).items() if k != "d2t"}
        m.update(tree_unflatten(list(new.items())))
        ids = np.arange(64) * 4 + 1
        m.d2t = mx.array((ids - np.arange(64)).astype(np.int32))
        mx.eval(m.parameters())
        import inspect

        kw = {}
        if "target" in inspect.signature(save_drafter).parameters:  # writers that record the target
            from mlxspec.targets.load import load_target

            kw["target"] = load_target(self.target)[0]
        save_drafter(m, cfg, self.drafter, "speculators", **kw)
        save_drafter(m, cfg, self.drafter_gguf, "gguf", **kw)

    # read-only and full file systems for the output-path cases: real tmpfs mounts when root
    # (which writes through mode bits), else a mode-0555 directory and no full-disk case
    def _mount(self, name: str, opts: str):
        d = os.path.join(self.root, name)
        if d in getattr(self, "_mounts", {}):
            return self._mounts[d]
        self._mounts = getattr(self, "_mounts", {})
        os.makedirs(d, exist_ok=True)
        ok = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", d],
                                                  capture_output=True).returncode == 0
        self._mounts[d] = d if ok else None
        return self._mounts[d]

    def read_only_dir(self) -> str:
        d = self._mount("ro-fs", "ro,size=64k")
        if d is None:
            d = os.path.join(self.root, "ro-dir")
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o555)
        return d

    def full_dir(self) -> str | None:
        d = self._mount("full-fs", "size=64k")
        if d is not None and not os.path.exists(os.path.join(d, "fill")):
            fd = os.open(os.path.join(d, "fill"), os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, b"\0" * 4096):
                    pass
            except OSError:  # ENOSPC: full
                pass
            finally:
                os.close(fd)
        return d

    def close(self) -> None:
        for d, mounted in getattr(self, "_mounts", {}).items():
            if mounted:
                subprocess.run(["umount", "-l", d], capture_output=True)
        self._mounts = {}

    def base_argv(self, model=None, draft="none", extra=()):
        return ["generate", "--model", model or self.target, "--draft", draft, "--prompt", PROMPT,
                "--max-tokens", MAX_TOKENS, "--verbose", "False", *extra]


# ============================================================================ cases

NUM_BOUNDARY = [0, -1, 2**32 - 1, 2**31, 2**63 - 1, 7, 10**12]
FLOAT_BOUNDARY = [0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e30, 1e-45]


def _wrong_typed(rng):
    return [(STR, "8", None), (ARR, [1, 2], I32), (F32, 2.5, None), (BOOL, True, None),
            (ARR, ["a"], STR), (F64, 4.0, None), (I64, 2, None)]


def gguf_target_cases(fx: Fixtures, rng) -> list[Case]:
    cases = []
    md, tensors = fx.md, fx.tensors

    def variant(cid, desc, md2=None, tensors2=None, arch="llama", alignment=None, expect="same"):
        def build(d, md2=md2, tensors2=tensors2, arch=arch, alignment=alignment):
            p = os.path.join(d, "t.gguf")
            write_gguf_file(p, arch, md if md2 is None else md2, tensors if tensors2 is None else tensors2, alignment)
            return {"@T": p}
        cases.append(Case(cid, "gguf-target", desc, fx.base_argv(model="@T"), expect=expect, build=build))

    # values: boundary numbers and wrong types for every model key
    for key, vt, val, _ in md:
        if not key.startswith("llama."):
            continue
        vals = ([(I32 if v < 0 else (U64 if v >= 2**32 else U32), v, None) for v in NUM_BOUNDARY] if vt == U32
                else [(F32, v, None) for v in FLOAT_BOUNDARY])
        wrong = [w for w in _wrong_typed(rng) if vt == U32 or w[0] not in (F32, F64, I64)]  # 2.5 is a valid base
        for nvt, nv, sub in vals + wrong:
            md2 = [(k, nvt, nv, sub) if k == key else (k, a, b, c) for k, a, b, c in md]
            variant(f"tgt-val-{key}-{nvt}-{nv!r}"[:120], f"{key} = {nv!r} (type {nvt})", md2)
    # dropped keys (required: refused; optional: default = baseline value)
    for key, *_ in md:
        variant(f"tgt-drop-{key}", f"drop {key}", [m for m in md if m[0] != key])
    # extra / wrong metadata
    for k, vt, v, sub in [("llama.vocab_size", U32, 300, None), ("llama.vocab_size", U32, 261, None),
                          ("llama.attention.key_length", U32, 32, None), ("llama.attention.key_length", U32, 0, None),
                          ("llama.rope.scaling.type", STR, "yarn", None), ("llama.rope.scaling.type", U32, 1, None),
                          ("llama.rope.scaling.type", STR, "linear", None), ("general.alignment", U32, 0, None),
                          ("general.alignment", U32, 3, None), ("general.alignment", STR, "32", None),
                          ("general.alignment", U32, 2**31, None), ("tokenizer.chat_template", U32, 5, None),
                          ("tokenizer.chat_template", ARR, ["{{x}}"], STR)]:
        variant(f"tgt-add-{k}-{v!r}", f"add {k} = {v!r}", md + [(k, vt, v, sub)])
    for arch in ("mamba", "qwen2", ""):
        md2 = [(k.replace("llama.", f"{arch}.") if arch else k, a, b, c) for k, a, b, c in md]
        variant(f"tgt-arch-{arch or 'empty'}", f"architecture {arch!r}", md2, arch=arch)
    # tokenizer metadata
    tok_muts = {
        "tokens-ints": ("tokenizer.ggml.tokens", ARR, list(range(261)), I32),
        "tokens-blank": ("tokenizer.ggml.tokens", ARR, [""] * 261, STR),
        "tokens-short": ("tokenizer.ggml.tokens", ARR, ["a", "b"], STR),
        "tokens-string": ("tokenizer.ggml.tokens", STR, "abc", None),
        "types-strings": ("tokenizer.ggml.token_type", ARR, ["1"] * 261, STR),
        "types-short": ("tokenizer.ggml.token_type", ARR, [1, 1], I32),
        "types-range": ("tokenizer.ggml.token_type", ARR, [99] * 261, I32),
        "merges-ints": ("tokenizer.ggml.merges", ARR, [1, 2, 3], I32),
        "merges-bad": ("tokenizer.ggml.merges", ARR, ["nospace", "a b c"], STR),
        "merges-unknown": ("tokenizer.ggml.merges", ARR, ["zz yy"], STR),
        "bos-range": ("tokenizer.ggml.bos_token_id", U32, 10**6, None),
        "eos-range": ("tokenizer.ggml.eos_token_id", U32, 2**32 - 1, None),
        "eos-string": ("tokenizer.ggml.eos_token_id", STR, "x", None),
        "model-unknown": ("tokenizer.ggml.model", STR, "sentencepiece-xl", None),
        "model-int": ("tokenizer.ggml.model", U32, 3, None),
        "addbos-string": ("tokenizer.ggml.add_bos_token", STR, "yes please", None),
    }
    for name, (k, vt, v, sub) in tok_muts.items():
        md2 = [(k, vt, v, sub) if m[0] == k else m for m in md]
        variant(f"tgt-tok-{name}", f"tokenizer {k} = {str(v)[:30]}", md2)
    # tensors: missing, extra, wrong shape, wrong type, absurd
    names = list(tensors)
    for n in rng.choice(names, 4, replace=False):
        variant(f"tgt-tensor-drop-{n}", f"drop tensor {n}", tensors2={k: v for k, v in tensors.items() if k != n})
    variant("tgt-tensor-extra", "extra tensor blk.5.attn_q.weight",
            tensors2={**tensors, "blk.5.attn_q.weight": tensors["blk.0.attn_q.weight"]})
    variant("tgt-tensor-unknown", "extra tensor foo.weight", tensors2={**tensors, "foo.weight": (np.zeros(8, np.float32), "F32")})
    for n in rng.choice([k for k in names if tensors[k][0].ndim == 2], 4, replace=False):
        a, kind = tensors[n]
        if a.shape[0] != a.shape[1]:  # a square one transposed is only different data
            variant(f"tgt-tensor-T-{n}", f"{n} transposed", tensors2={**tensors, n: (np.ascontiguousarray(a.T), kind)})
        variant(f"tgt-tensor-cut-{n}", f"{n} one row short", tensors2={**tensors, n: (a[:-1], kind)})
        variant(f"tgt-tensor-q-{n}", f"{n} as Q8_0", tensors2={**tensors, n: (a, "Q8_0")}, expect="same-or-error")
    variant("tgt-block-count-3", "block_count 3 with 2 layers of tensors",
            [(k, a, 3 if k == "llama.block_count" else b, c) for k, a, b, c in md])
    variant("tgt-block-count-1", "block_count 1 with 2 layers of tensors",
            [(k, a, 1 if k == "llama.block_count" else b, c) for k, a, b, c in md])
    variant("tgt-block-count-4G", "block_count 2^32-1",
            [(k, a, 2**32 - 1 if k == "llama.block_count" else b, c) for k, a, b, c in md])
    return cases


def _patched(data: bytes, start: int, new: bytes) -> bytes:
    return data[:start] + new + data[start + len(new):]


def raw_cases(fx: Fixtures, rng, n_flips: int, base_name: str, data: bytes, layout, data_start, group, argv_of) -> list[Case]:
    """Byte flips at structural fields, truncations at every structural boundary, table patches."""
    cases = []

    def add(cid, desc, blob):
        def build(d, blob=blob):
            p = os.path.join(d, base_name)
            with open(p, "wb") as f:
                f.write(blob)
            return {"@F": p}
        cases.append(Case(cid, group, desc, argv_of("@F"), build=build))
        if rng.random() < 0.25:  # `mlxspec inspect` on the same file: a report or one line
            cases.append(Case(cid + "-inspect", "inspect", desc, ["inspect", "@F"], expect="run-or-error", build=build))

    flippable = [f for f in layout if f[0] in FLIPPABLE or (f[0] == "key" and f[3].split(".")[0] in
                                                              ("llama", "dflash", "general"))]
    for i in range(n_flips):
        kind, start, length, label = flippable[rng.integers(len(flippable))]
        pos = start + int(rng.integers(length)) if length else start
        bit = int(rng.integers(8))
        blob = bytearray(data)
        if pos >= len(blob):
            continue
        blob[pos] ^= 1 << bit
        add(f"{group}-flip-{i}-{kind}-{pos}.{bit}", f"flip bit {bit} of byte {pos} ({kind} {label})", bytes(blob))
    # truncation at every structural boundary (a sample when there are many) plus data cuts
    bounds = sorted({s for _, s, _, _ in layout} | {data_start, len(data) - 1, (data_start + len(data)) // 2})
    if len(bounds) > 40:
        bounds = sorted(set(rng.choice(bounds, 40, replace=False).tolist()) | {data_start, len(data) - 1})
    for b in bounds:
        add(f"{group}-trunc-{b}", f"truncated at byte {b}", data[:b])
    # tensor table patches
    offs = [f for f in layout if f[0] == "t_offset"]
    names = [f for f in layout if f[0] == "t_name"]
    dims = [f for f in layout if f[0] == "t_dim"]
    types = [f for f in layout if f[0] == "t_type"]
    ndims = [f for f in layout if f[0] == "t_ndims"]
    if len(offs) > 1:
        k = int(rng.integers(1, len(offs)))
        prev = data[offs[k - 1][1]:offs[k - 1][1] + 8]
        add(f"{group}-overlap-{k}", f"tensor {offs[k][3]} at the previous tensor's offset", _patched(data, offs[k][1], prev))
        o = struct.unpack("<Q", data[offs[k][1]:offs[k][1] + 8])[0]
        add(f"{group}-misalign-{k}", f"tensor {offs[k][3]} offset + 1", _patched(data, offs[k][1], struct.pack("<Q", o + 1)))
        add(f"{group}-outfile-{k}", f"tensor {offs[k][3]} offset 2^40", _patched(data, offs[k][1], struct.pack("<Q", 1 << 40)))
        add(f"{group}-offset-max", f"tensor {offs[-1][3]} offset 2^64-32",
            _patched(data, offs[-1][1], struct.pack("<Q", 2**64 - 32)))
    # duplicate name: same-length names differing in one byte
    by_len = {}
    for f in names:
        by_len.setdefault(f[2], []).append(f)
    dup = [v for v in by_len.values() if len(v) > 1]
    if dup:
        a, b = dup[0][0], dup[0][1]
        add(f"{group}-dupname", f"tensor {b[3] or 'b'} renamed to {a[3] or 'a'}", _patched(data, b[1], data[a[1]:a[1] + a[2]]))
    for d in rng.choice(len(dims), min(3, len(dims)), replace=False):
        f = dims[d]
        for v in (0, 2**40, 2**63 - 1, 2**64 - 1):
            add(f"{group}-dim-{d}-{v}", f"a dimension of {f[3]} = {v}", _patched(data, f[1], struct.pack("<Q", v)))
    for t in rng.choice(len(types), min(2, len(types)), replace=False):
        f = types[t]
        for v in (1, 2, 8, 99, 2**31):
            add(f"{group}-type-{t}-{v}", f"type of {f[3]} = {v}", _patched(data, f[1], struct.pack("<I", v)))
    if ndims:
        f = ndims[0]
        for v in (0, 5, 2**31):
            add(f"{group}-ndims-{v}", f"n_dims of {f[3]} = {v}", _patched(data, f[1], struct.pack("<I", v)))
    hdr = {f[0]: f for f in layout[:4]}
    for v in (0, 1, 2**63):
        add(f"{group}-ntensors-{v}", f"n_tensors = {v}", _patched(data, hdr["n_tensors"][1], struct.pack("<Q", v)))
        add(f"{group}-nkv-{v}", f"n_kv = {v}", _patched(data, hdr["n_kv"][1], struct.pack("<Q", v)))
    # nested arrays deep enough to exhaust Python's recursion: appended as one extra kv
    return cases


def hf_drafter_cases(fx: Fixtures, rng) -> list[Case]:
    cases = []
    cfg = json.load(open(os.path.join(fx.drafter, "config.json")))

    def variant(cid, desc, config_text=None, mutate_st=None, expect="same"):
        def build(d, config_text=config_text, mutate_st=mutate_st):
            p = os.path.join(d, "drafter")
            shutil.copytree(fx.drafter, p)
            if config_text is not None:
                with open(os.path.join(p, "config.json"), "w") as f:
                    f.write(config_text)
            if mutate_st is not None:
                mutate_st(os.path.join(p, "model.safetensors"))
            return {"@D": p}
        cases.append(Case(cid, "hf-drafter", desc, fx.base_argv(draft="@D"), expect=expect, build=build))

    def with_(path, value):
        c = json.loads(json.dumps(cfg))
        node = c
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return json.dumps(c)

    for text, desc in [("[]", "a list"), ('"x"', "a string"), ("3", "a number"), ("null", "null"), ("{", "invalid"),
                       ("", "empty"), ("\xff\xfe", "not UTF-8"), ("[" * 100000, "deeply nested")]:
        variant(f"hf-config-{desc}", f"config.json is {desc}", text)
    bad_values = [0, -1, 1.5, "8", None, [4], 10**9, True, float("nan"), float("inf"), 2**63]
    for key in ("block_size", "mask_token_id"):
        for v in bad_values:
            variant(f"hf-{key}-{v!r}", f"{key} = {v!r}", with_([key], v))
    for v in ([1.5], [1, 1], [-5], [10**6], ["1"], [], "1", [1.0], None, [0], [2]):
        variant(f"hf-taps-{v!r}", f"aux_hidden_state_layer_ids = {v!r}", with_(["aux_hidden_state_layer_ids"], v))
    tl = "transformer_layer_config"
    for key, vals in {"rope_theta": [0, -1.0, float("nan"), float("inf"), "1e4", None],
                      "rms_norm_eps": [0, -1e-6, float("nan"), "x"],
                      "hidden_size": [0, -1, 255, 1.5, "256", 10**9],
                      "num_attention_heads": [0, 3, -4], "num_key_value_heads": [0, 3],
                      "num_hidden_layers": [0, 10**6, 2], "intermediate_size": [0, 127],
                      "head_dim": [0, 63, 10**7], "vocab_size": [0, 260, 2**40]}.items():
        for v in vals:
            variant(f"hf-{key}-{v!r}", f"{tl}.{key} = {v!r}", with_([tl, key], v))
    variant("hf-tl-list", f"{tl} is a list", with_([tl], [1]))
    for key, v in [("markov_rank", -1), ("markov_rank", 1.5), ("markov_rank", 5), ("min_log_snr", "x"),
                   ("max_log_snr", float("nan")), ("speculators_model_type", "eagle"),
                   ("target_hidden_size", 128), ("sample_from_anchor", "maybe")]:
        variant(f"hf-{key}-{v!r}", f"{key} = {v!r}", with_([key], v))

    # safetensors weights
    def st_edit(fn):
        def mutate(p):
            from safetensors.numpy import load_file, save_file

            t = load_file(p)
            fn(t)
            save_file(t, p)
        return mutate

    def nan_in(t, name=None, val=np.nan):
        k = name or sorted(k for k in t if np.issubdtype(t[k].dtype, np.floating))[0]
        a = t[k].copy()
        a.reshape(-1)[0] = val
        t[k] = a

    variant("st-nan", "a NaN weight", mutate_st=st_edit(lambda t: nan_in(t)))
    variant("st-inf", "an Inf weight", mutate_st=st_edit(lambda t: nan_in(t, val=np.inf)))
    variant("st-nan-markov", "a NaN Markov weight", mutate_st=st_edit(lambda t: nan_in(t, "markov_head.markov_w1.weight")))
    for v in (10**6, -10**6, 272, -2):
        variant(f"st-d2t-{v}", f"d2t entry {v}", mutate_st=st_edit(lambda t, v=v: t.__setitem__(
            "d2t", np.concatenate([t["d2t"][:-1], np.array([v], t["d2t"].dtype)]))))
    variant("st-d2t-float", "d2t as float", mutate_st=st_edit(lambda t: t.__setitem__("d2t", t["d2t"].astype(np.float32))))
    variant("st-drop", "a tensor missing", mutate_st=st_edit(lambda t: t.pop(sorted(t)[0])))
    variant("st-extra", "an extra tensor", mutate_st=st_edit(lambda t: t.__setitem__("zzz.weight", np.zeros(3, np.float32))))

    def raw_edit(fn):
        def mutate(p):
            with open(p, "rb") as f:
                data = f.read()
            with open(p, "wb") as f:
                f.write(fn(data))
        return mutate

    def header_edit(fn):
        def edit(data):
            n = struct.unpack("<Q", data[:8])[0]
            h = json.loads(data[8:8 + n])
            fn(h)
            hb = json.dumps(h).encode()
            hb += b" " * (-len(hb) % 8)
            return struct.pack("<Q", len(hb)) + hb + data[8 + n:]
        return edit

    def overlap(h):
        ks = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
        h[ks[1]]["data_offsets"] = [h[ks[0]]["data_offsets"][0],
                                    h[ks[0]]["data_offsets"][0] + h[ks[1]]["data_offsets"][1] - h[ks[1]]["data_offsets"][0]]

    def shape_lie(h):
        k = sorted(k for k in h if k != "__metadata__")[0]
        h[k]["shape"] = [10**9, 10**9]

    def dtype_lie(h):
        k = sorted(k for k in h if k != "__metadata__" and h[k]["dtype"] == "F32")[0]
        h[k]["dtype"] = "F64"

    def offsets_out(h):
        k = sorted(k for k in h if k != "__metadata__")[-1]
        h[k]["data_offsets"] = [2**40, 2**40 + 4]

    for name, fn in [("overlap", header_edit(overlap)), ("shape-lie", header_edit(shape_lie)),
                     ("dtype-lie", header_edit(dtype_lie)), ("offsets-out", header_edit(offsets_out)),
                     ("hdrlen-huge", lambda d: struct.pack("<Q", 2**62) + d[8:]),
                     ("hdrlen-zero", lambda d: struct.pack("<Q", 0) + d[8:]),
                     ("hdr-garbage", lambda d: d[:8] + b"\xff" * 16 + d[24:]),
                     ("trailing", lambda d: d + b"\0" * 64), ("empty", lambda d: b""),
                     ("short", lambda d: d[:5])]:
        variant(f"st-{name}", f"safetensors {name}", mutate_st=raw_edit(fn))
    for cut in sorted(set(rng.integers(9, os.path.getsize(os.path.join(fx.drafter, "model.safetensors")), 6).tolist())):
        variant(f"st-trunc-{cut}", f"safetensors truncated at {cut}", mutate_st=raw_edit(lambda d, c=cut: d[:c]))
    return cases


def hf_target_cases(fx: Fixtures, rng) -> list[Case]:
    """An MLX/HF target directory (written by `mlxspec convert`): config.json and safetensors mutations."""
    cases = []
    cfg = json.load(open(os.path.join(fx.hf_target, "config.json")))

    def variant(cid, desc, config=None, mutate_st=None, text=None, mention=None):
        def build(d):
            p = os.path.join(d, "tm")
            shutil.copytree(fx.hf_target, p)
            if config is not None or text is not None:
                with open(os.path.join(p, "config.json"), "w") as f:
                    f.write(text if text is not None else json.dumps({**cfg, **config}))
            if mutate_st is not None:
                mutate_st(os.path.join(p, "model.safetensors"))
            return {"@M": p}
        cases.append(Case(cid, "hf-target", desc, fx.base_argv(model="@M"), build=build, mention=mention))

    variant("hft-baseline", "unmodified converted directory", config={})
    # a dimension that disagrees with the weights (integral, in range): the error names the key (issue 25)
    for key in ("hidden_size", "intermediate_size", "vocab_size"):
        for delta in (-1, 1, 64, -64):
            v = cfg[key] + delta
            variant(f"hft-dim-{key}{delta:+d}", f"config.json {key} = {v} (weights: {cfg[key]})", config={key: v},
                    mention=key)
    for text, desc in [("[]", "a list"), ("{", "invalid JSON"), ('"x"', "a string")]:
        variant(f"hft-config-{desc}", f"config.json is {desc}", text=text)
    for key, vals in {"hidden_size": [0, -1, "256", 255, 1.5], "num_hidden_layers": [0, 10**9, 3, 1],
                      "num_attention_heads": [0, 3], "num_key_value_heads": [0, 3], "intermediate_size": [0, 255],
                      "vocab_size": [0, 271, 2**40], "rms_norm_eps": [-1.0, 0, "x"], "rope_theta": [0, -1.0, "x"],
                      "max_position_embeddings": [0, -5, "x"], "model_type": ["mamba", 5, None],
                      "head_dim": [0, 63]}.items():
        for v in vals:
            variant(f"hft-{key}-{v!r}", f"config.json {key} = {v!r}", config={key: v})

    def st(fn):
        def mutate(p):
            from safetensors.numpy import load_file, save_file

            t = load_file(p)
            fn(t)
            save_file(t, p, metadata={"format": "mlx"})
        return mutate

    def nan(t):
        k = "model.layers.0.mlp.up_proj.weight"
        a = t[k].copy()
        a[0, 0] = np.nan
        t[k] = a
    variant("hft-st-nan", "a NaN target weight", mutate_st=st(nan))
    variant("hft-st-drop", "a tensor missing", mutate_st=st(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")))
    variant("hft-st-shape", "a tensor transposed", mutate_st=st(
        lambda t: t.__setitem__("model.embed_tokens.weight", np.ascontiguousarray(t["model.embed_tokens.weight"].T))))
    variant("hft-st-trunc", "safetensors truncated", mutate_st=lambda p: open(p, "r+b").truncate(os.path.getsize(p) // 2))
    return cases


PLAIN_NP = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def retyped(a: np.ndarray, to: str) -> np.ndarray:
    """A plain tensor stored as ggml type `to`: the same bytes relabelled where the element
    sizes match (I32 ids read as F32, as a wrong type in the file gives), else the values
    converted."""
    dt = np.dtype(PLAIN_NP[to])
    return a.view(dt) if dt.itemsize == a.dtype.itemsize else a.astype(dt)


def rewrite_gguf(src: str, dst: str, set_keys: dict, drop=(), retype=None) -> None:
    """Copy a GGUF through gguf.GGUFReader -> GGUFWriter, setting {key: (vtype, value, subtype)};
    retype: {tensor name: ggml type} for plain tensors (see `retyped`)."""
    import gguf

    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in drop or k in set_keys:
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[1] if len(f.types) > 1 else None)
    for k, (vt, v, sub) in set_keys.items():
        w.add_key_value(k, v, gguf.GGUFValueType(vt), sub_type=None if sub is None else gguf.GGUFValueType(sub))
    for t in r.tensors:
        plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                                  gguf.GGMLQuantizationType.I32)
        a = np.array(t.data)
        if retype and t.name in retype:
            a, plain = retyped(a, retype[t.name]), True
        w.add_tensor(t.name, a, raw_dtype=None if plain else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_drafter_cases(fx: Fixtures, rng) -> list[Case]:
    cases = []

    def variant(cid, desc, set_keys=None, drop=(), retype=None, expect="same", group="gguf-drafter"):
        def build(d):
            p = os.path.join(d, "dr.gguf")
            rewrite_gguf(fx.drafter_gguf, p, set_keys or {}, drop, retype)
            return {"@D": p}
        cases.append(Case(cid, group, desc, fx.base_argv(draft="@D"), expect=expect, build=build))

    variant("dg-rewrite", "rewritten unchanged")
    muts = {"dflash.block_size": [(U32, 0), (I32, -1), (U32, 10**6), (STR, "8"), (STR, "x"), (F32, 4.5)],
            "dflash.target_layers": [(ARR, [0], I32), (ARR, [1, 1], I32), (ARR, [100], I32), (ARR, ["1"], STR),
                                     (U32, 1), (ARR, [2], I32)],
            "tokenizer.ggml.mask_token_id": [(U32, 10**9), (STR, "x"), (I32, -1)],
            "dflash.attention.head_count": [(U32, 0), (U32, 3), (STR, "4")],
            "dflash.attention.head_count_kv": [(U32, 0), (U32, 3)],
            "dflash.embedding_length": [(U32, 0), (U32, 128), (ARR, [256], I32)],
            "dflash.block_count": [(U32, 0), (U32, 2**31), (U32, 2)],
            "dflash.vocab_size": [(U32, 0), (U32, 271), (STR, "x")],
            "dflash.attention.layer_norm_rms_epsilon": [(F32, 0.0), (F32, -1.0), (F32, float("nan")), (STR, "x")],
            "dflash.rope.freq_base": [(F32, 0.0), (F32, float("nan")), (F32, float("inf"))],
            "dflash.markov_rank": [(I32, -1), (U32, 5), (U32, 0), (F32, 4.5)],
            "dflash.sample_from_anchor": [(STR, "maybe"), (U32, 2)],
            "dflash.log_snr_conditioning": [(BOOL, True), (STR, "yes please")],
            "dflash.confidence_head": [(BOOL, False), (U32, 7)]}
    for key, vals in muts.items():
        for vt, v, *sub in vals:
            variant(f"dg-{key}-{vt}-{v!r}"[:100], f"{key} = {v!r}", {key: (vt, v, sub[0] if sub else None)})
    for key in ("dflash.block_count", "dflash.target_layers", "tokenizer.ggml.mask_token_id", "dflash.embedding_length",
                "dflash.markov_rank", "dflash.sample_from_anchor"):
        variant(f"dg-drop-{key}", f"drop {key}", drop=(key,))
    for lo, hi in ((float("nan"), 9.0), (5.0, -5.0), ("x", 9.0)):
        variant(f"dg-snr-{lo!r}-{hi!r}", f"log-SNR on, bounds {lo!r}..{hi!r}",
                {"dflash.log_snr_conditioning": (BOOL, True, None),
                 "dflash.min_log_snr": (STR if isinstance(lo, str) else F32, lo, None),
                 "dflash.max_log_snr": (F32, hi, None)})
    return cases


def gguf_type_cases(fx: Fixtures) -> list[Case]:
    """Every tensor of the GGUF drafter stored in every plain ggml type, written with GGUFWriter.
    d2t must be integer ids (I64 holds the same ids: same output); weights float (F16 <-> F32
    may round: same output or an error) and never integer (the float bits read as integers)."""
    cases = []
    for name, kind in fx.dg_types.items():
        for to in PLAIN_NP:
            if to == kind:
                continue
            if name == "d2t":
                expect = "same" if to == "I64" else "error"
            else:
                expect = "error" if to.startswith("I") else "same-or-error"

            def build(d, name=name, to=to):
                p = os.path.join(d, "dr.gguf")
                rewrite_gguf(fx.drafter_gguf, p, {}, retype={name: to})
                return {"@D": p}
            cases.append(Case(f"dg-type-{name}-{to}", "gguf-types", f"tensor {name} ({kind}) stored as {to}",
                              fx.base_argv(draft="@D"), expect=expect, build=build))
    return cases


def text_cases(fx: Fixtures, rng) -> list[Case]:
    """Text that is not UTF-8 in every text input (issue 25): --prompt, --system-prompt, --stop
    as Python hands argv bytes over (surrogateescape), and stdin as raw bytes. Invalid bytes are
    generated (stray continuation bytes, truncated sequences, overlong forms, UTF-16 surrogates,
    0xfe/0xff) at random places in valid text; each must be refused in one line. Valid
    non-ASCII text must run."""
    bad_seqs = [b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98", b"\xc0\xaf",
                b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xf4\x90\x80\x80"]
    good = ["héllo wörld", "日本語のテキスト", "emoji 🙂 ok", "Ωmega ∑"]
    cases = []
    for i in range(16):
        base = (PROMPT + " " + good[i % len(good)]).encode()
        at = int(rng.integers(0, len(base) + 1))
        while at < len(base) and (base[at] & 0xC0) == 0x80:  # between characters, not inside one
            at += 1
        raw = base[:at] + bad_seqs[i % len(bad_seqs)] + base[at:]
        text = raw.decode("utf-8", "surrogateescape")
        where = ["--prompt", "--system-prompt", "--stop", "stdin"][i % 4]
        argv = fx.base_argv()
        stdin = None
        if where == "--prompt":
            argv[argv.index("--prompt") + 1] = text
        elif where == "stdin":
            argv[argv.index("--prompt") + 1] = "-"
            stdin = raw
        else:
            argv += [where, text]
        cases.append(Case(f"text-{where.strip('-')}-{i}", "text", f"{where} with {raw[at:at + 5]!r} at byte {at}",
                          argv, stdin=stdin, expect="error", mention="not UTF-8 text"))
    for i, t in enumerate(good):
        argv = fx.base_argv()
        argv[argv.index("--prompt") + 1] = t
        cases.append(Case(f"text-good-{i}", "text", f"--prompt {t!r}", argv + ["--stop", t[-2:]], expect="ok"))
    cases.append(Case("api-prompt-surrogate", "api", "stream_generate(prompt with a lone surrogate)", expect="error",
                      api={"kwargs": {"prompt": "the \ud800 the"}}))
    cases.append(Case("api-stop-surrogate", "api", "stream_generate(stop=[lone surrogate])", expect="error",
                      api={"kwargs": {"stop": ["\udcff"]}}))
    return cases


def output_cases(fx: Fixtures) -> list[Case]:
    """Every output path (convert / bench / train --out) under every bad parent (issue 25): a
    parent that is a file, a device (/dev/null/x), read-only, or a file system with no space
    left; each refused in one line before any work (or while writing). A missing parent is
    created (mkdir -p): convert must run. Read-only and full file systems are real tmpfs
    mounts (root) or a mode-0555 directory (others; no full-disk case then)."""
    T = fx.target
    commands = {"convert": lambda out: ["convert", "--model", T, "--out", out],
                "bench": lambda out: ["bench", "--model", T, "--draft", "none", "--quick", "--out", out],
                "train": lambda out: ["train", "--model", T, "--out", out]}

    def in_file(d):
        f = os.path.join(d, "file")
        open(f, "w").close()
        return os.path.join(f, "out")

    parents = {"devnull": (lambda d: "/dev/null/x", "/dev/null is not a directory"),
               "file": (in_file, "is not a directory"),
               "file-deep": (lambda d: os.path.join(in_file(d), "a", "b"), "is not a directory"),
               "readonly": (lambda d: os.path.join(fx.read_only_dir(), "out"), "cannot write into"),
               "full": (lambda d: os.path.join(fx.full_dir(), "out"), "free some space")}
    cases = []
    for cmd, argv in commands.items():
        for name, (where, mention) in parents.items():
            if name == "full" and (fx.full_dir() is None or cmd == "train"):  # train: no size to check up front
                continue
            cases.append(Case(f"out-{cmd}-{name}", "outputs", f"{cmd} --out under a {name} parent", argv("@OUT"),
                              expect="error", mention=mention, build=lambda d, w=where: {"@OUT": w(d)}))
    cases.append(Case("out-convert-missing-parents", "outputs", "convert --out a/b/c (missing parents: created)",
                      commands["convert"]("@OUT"), expect="ok",
                      build=lambda d: {"@OUT": os.path.join(d, "a", "b", "c")}))
    return cases


def message_cases(fx: Fixtures) -> list[Case]:
    """Drafter configs whose error used to blame the wrong thing (issue 25): each must name the cause."""
    cfg = json.load(open(os.path.join(fx.drafter, "config.json")))
    cases = []

    def variant(cid, desc, mutate, mention):
        def build(d):
            p = os.path.join(d, "drafter")
            shutil.copytree(fx.drafter, p)
            c = json.loads(json.dumps(cfg))
            mutate(c)
            with open(os.path.join(p, "config.json"), "w") as f:
                json.dump(c, f)
            return {"@D": p}
        cases.append(Case(cid, "messages", desc, fx.base_argv(draft="@D"), expect="error", mention=mention,
                          build=build))

    variant("msg-no-layer-config", "speculators without transformer_layer_config",
            lambda c: c.pop("transformer_layer_config"), "no transformer_layer_config")
    variant("msg-no-layer-config-th", "speculators without transformer_layer_config, target_hidden_size kept",
            lambda c: (c.pop("transformer_layer_config"), c.__setitem__("target_hidden_size", 576)),
            "no transformer_layer_config")
    variant("msg-no-layer-hidden", "transformer_layer_config without hidden_size",
            lambda c: c["transformer_layer_config"].pop("hidden_size"), "transformer_layer_config names none")
    for drop in (("speculators_model_type",), ("speculators_model_type", "speculators_config"),
                 ("speculators_model_type", "transformer_layer_config")):
        variant("msg-no-type-" + "-".join(drop), f"speculators without {', '.join(drop)}",
                lambda c, drop=drop: [c.pop(k) for k in drop], "no speculators_model_type")
    return cases


def flag_cases(fx: Fixtures) -> list[Case]:
    cases = []
    T = fx.target

    def flag(cid, extra, expect, draft="none", stdin=None, prompt=PROMPT, desc=None):
        argv = fx.base_argv(draft=draft)
        argv[argv.index("--prompt") + 1] = prompt
        argv += extra
        cases.append(Case(cid, "flags", desc or " ".join(extra) or prompt, argv, stdin=stdin, expect=expect))

    bad = {"--max-tokens": ["0", "-1"], "--temp": ["-1", "nan", "inf", "-inf"], "--top-p": ["0", "1.5", "nan", "-0.1"],
           "--top-k": ["-1"], "--p-min": ["-0.1", "1.1", "nan"], "--seed": ["-1"], "--block-size": ["0", "-1", "1000000"],
           "--num-draft-tokens": ["0", "-1"]}
    for f, vals in bad.items():
        for v in vals:
            flag(f"flag{f}={v}", [f, v], "error", draft=fx.drafter if f in ("--block-size", "--p-min") else "none")
    for f, v in [("--max-tokens", "x"), ("--temp", "x"), ("--seed", "1.5"), ("--verbose", "maybe")]:
        flag(f"flag{f}={v}-parse", [f, v], "error")
    good = {"--max-tokens": ["1"], "--temp": ["0", "0.5"], "--top-p": ["1", "0.5"], "--top-k": ["0", "5"],
            "--seed": ["0", "123"]}
    for f, vals in good.items():
        for v in vals:
            flag(f"flag{f}={v}-ok", [f, v, "--temp", "0.7"] if f in ("--top-p", "--top-k", "--seed") else [f, v], "ok")
    flag("flag-pmin-ok", ["--p-min", "0.5"], "ok", draft=fx.drafter)
    flag("flag-block-ok", ["--block-size", "2"], "same", draft=fx.drafter)
    flag("flag-drafter-same", [], "same", draft=fx.drafter)
    flag("flag-drafter-gguf-same", [], "same", draft=fx.drafter_gguf)
    flag("prompt-empty", [], "error", prompt="")
    flag("prompt-space", [], "error", prompt="  \n ")
    flag("stdin-empty", [], "error", prompt="-", stdin=b"")
    flag("stdin-nonutf8", [], "error", prompt="-", stdin=b"the \xff\xfe the")
    flag("stdin-ok", [], "same", prompt="-", stdin=PROMPT.encode())
    flag("sysprompt-ignore", ["--system-prompt", "be nice", "--ignore-chat-template"], "error")
    flag("sysprompt-no-template", ["--system-prompt", "be nice"], "error")
    flag("context-prompt", [], "error", prompt="the " * 600, desc="600-token prompt, context 512")
    flag("context-maxtokens", ["--max-tokens", "100000"], "error")
    flag("context-1mb", [], "error", prompt="x" * (1 << 20), desc="1 MB prompt")
    flag("spec-type-bad", ["--spec-type", "eagle"], "error")
    for extra in (["--steps", "0"], ["--block-size", "0"], ["--block-size", "100000"], ["--lr", "nan"], ["--lr", "-1"],
                  ["--taps", "a,b"], ["--taps", "1,1"], ["--taps", "-3"], ["--tokens", "code=x"], ["--tokens", "code=0"],
                  ["--seq-len", "1"], ["--prefix-len", "0"], ["--seqs-per-step", "0"], ["--seed", "-1"],
                  ["--layers", "0"], ["--data-seconds", "-5"]):
        cases.append(Case(f"train{'='.join(extra)}", "flags", "train " + " ".join(extra),
                          ["train", "--model", T, "--out", "@OUT", *extra], expect="error",
                          build=lambda d: {"@OUT": os.path.join(d, "run")}))
    cases.append(Case("convert-non-empty", "files", "convert into a non-empty --out without --force",
                      ["convert", "--model", T, "--out", "@OUT"], expect="error",
                      build=lambda d: (open(os.path.join(d, "x"), "w").close(), {"@OUT": d})[1]))
    cases.append(Case("convert-out-is-file", "files", "convert --out a file", ["convert", "--model", T, "--out", "@OUT"],
                      expect="error", build=lambda d: (open(os.path.join(d, "x"), "w").close(),
                                                       {"@OUT": os.path.join(d, "x")})[1]))
    cases.append(Case("fifo-model", "files", "a FIFO as --model", fx.base_argv(model="@FIFO"), expect="error",
                      build=lambda d: (os.mkfifo(os.path.join(d, "fifo.gguf")), {"@FIFO": os.path.join(d, "fifo.gguf")})[1]))

    def fifo_drafter(d, what):
        p = os.path.join(d, "drafter")
        shutil.copytree(fx.drafter, p)
        os.remove(os.path.join(p, what))
        os.mkfifo(os.path.join(p, what))
        return {"@D": p}
    for what in ("config.json", "model.safetensors"):
        cases.append(Case(f"fifo-drafter-{what}", "files", f"a FIFO as the drafter's {what}", fx.base_argv(draft="@D"),
                          expect="error", build=lambda d, w=what: fifo_drafter(d, w)))
    cases.append(Case("fifo-inspect", "files", "mlxspec inspect FIFO", ["inspect", "@FIFO"], expect="error",
                      build=lambda d: (os.mkfifo(os.path.join(d, "f.gguf")), {"@FIFO": os.path.join(d, "f.gguf")})[1]))
    cases.append(Case("fifo-draft-gguf", "files", "a FIFO as --draft", fx.base_argv(draft="@FIFO"), expect="error",
                      build=lambda d: (os.mkfifo(os.path.join(d, "d.gguf")), {"@FIFO": os.path.join(d, "d.gguf")})[1]))
    cases.append(Case("model-dir-missing", "files", "--model a missing path", fx.base_argv(model="/nonexistent/x.gguf"),
                      expect="error"))
    cases.append(Case("model-is-dir", "files", "--model an empty directory", fx.base_argv(model="@DIR"), expect="error",
                      build=lambda d: (os.makedirs(os.path.join(d, "empty")), {"@DIR": os.path.join(d, "empty")})[1]))
    return cases


def api_cases(fx: Fixtures) -> list[Case]:
    cases = []
    bad = [("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.5), ("max_tokens", None), ("temp", -1.0),
           ("temp", float("nan")), ("temp", float("inf")), ("temp", "0"), ("top_p", 0.0), ("top_p", 1.5),
           ("top_p", float("nan")), ("top_k", -1), ("top_k", 1.5), ("seed", -1), ("seed", "1"), ("stop", "x"),
           ("stop", [1]), ("prompt", [-1]), ("prompt", [272]), ("prompt", [2**40]), ("prompt", [1.5]), ("prompt", []),
           ("prompt", ""), ("prompt", [5] * 600)]
    for k, v in bad:
        cases.append(Case(f"api-{k}={v!r}"[:80], "api", f"stream_generate({k}={v!r})", expect="error",
                          api={"kwargs": {k: v}}))
    for k, v in [("p_min", -0.5), ("p_min", 2.0), ("block_size", 0), ("num_draft_tokens", 0), ("spec_type", "x")]:
        cases.append(Case(f"api-load-{k}={v!r}", "api", f"load_speculator({k}={v!r})", expect="error",
                          api={"load": {k: v}}))
    for kw in ({"model": 5}, {"model": ["x.gguf"]}, {"model": "/nonexistent.gguf"}, {"model": fx.target, "draft": 3}):
        cases.append(Case(f"api-load-{sorted(kw.items())!r}"[:80], "api", f"load({kw!r})", expect="error",
                          api={"loadfull": kw}))
    cases.append(Case("api-ok", "api", "stream_generate() baseline", expect="same", api={"kwargs": {}}))
    return cases


def regression_cases(fx: Fixtures) -> list[Case]:
    """Defects a larger campaign found (issue 39), always run: a GGUF whose general.alignment
    is 1 (it read every tensor from a shifted offset and ended in "non-finite logits"), train
    --taps on the target's final layer (it ran on until the memory cap), and train itself on the
    tiny target's 272-token vocabulary (its top-k search crashed on fewer than 8 x 64 tokens)."""
    T = fx.target
    cases = []
    for align_key, writer in ((1, None), (1, 1), (4, 4)):
        def build(d, k=align_key, w=writer):
            p = os.path.join(d, "t.gguf")
            write_gguf_file(p, "llama", fx.md + [("general.alignment", U32, k, None)], fx.tensors, w)
            return {"@T": p}
        cases.append(Case(f"tgt-alignment-{align_key}-written-{writer or 32}", "gguf-target",
                          f"general.alignment = {align_key}, data padded to {writer or 32}", fx.base_argv(model="@T"),
                          expect="error", mention="general.alignment", build=build))

    def dirs(d):
        return {"@OUT": os.path.join(d, "run"), "@DATA": os.path.join(d, "data")}
    cases.append(Case("train-taps-final-layer", "flags", "train --taps 0,1 on a 2-layer target (1 is the final layer)",
                      ["train", "--model", T, "--out", "@OUT", "--data", "@DATA", "--taps", "0,1"], expect="error",
                      mention="last layer", build=dirs))
    cases.append(Case("train-tiny-vocab-prepare", "flags", "train --prepare-only on the 272-token vocabulary",
                      ["train", "--model", T, "--out", "@OUT", "--data", "@DATA", "--prepare-only", "--corpus",
                       "fortunes=/usr/share/games/fortunes/*", "--tokens", "fortunes=64", "--seq-len", "16"],
                      expect="ok", build=dirs))
    return cases


def all_cases(fx: Fixtures, n: int, seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    types = gguf_type_cases(fx)
    always = [c for c in types if c.id.startswith("dg-type-d2t-") or c.id.endswith("-I32")]  # ids; float bits as ints
    fixed = flag_cases(fx) + api_cases(fx) + always + text_cases(fx, rng) + output_cases(fx) + message_cases(fx)
    fixed += regression_cases(fx)
    pool = gguf_target_cases(fx, rng) + hf_drafter_cases(fx, rng) + hf_target_cases(fx, rng)
    pool += [c for c in types if c not in always]
    pool += gguf_drafter_cases(fx, rng)
    pool += raw_cases(fx, rng, max(40, n // 2), "t.gguf", fx.target_bytes, fx.layout, fx.data_start, "raw-target",
                      lambda p: fx.base_argv(model=p))
    pool += raw_cases(fx, rng, max(15, n // 5), "d.gguf", fx.dg_bytes, fx.dg_layout, fx.dg_data_start, "raw-drafter",
                      lambda p: fx.base_argv(draft=p))
    k = max(0, n - len(fixed))
    if k < len(pool):
        pool = [pool[i] for i in sorted(rng.choice(len(pool), k, replace=False))]
    return (fixed + pool)[:n] if n < len(fixed) else fixed + pool


# ============================================================================ worker

def _worker_main():
    import resource

    cap = int(os.environ.get("MLXSPEC_FUZZ_MEM", MEM_CAP))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    os.environ["MLXSPEC_NO_BLAS_REEXEC"] = "1"
    from mlxspec import api, cli
    from mlxspec.errors import MlxspecError

    state = {}

    class _Timeout(BaseException):
        pass

    def on_alarm(*_):
        raise _Timeout()

    signal.signal(signal.SIGALRM, on_alarm)
    out = os.fdopen(os.dup(1), "w")  # the protocol channel; fd 1 itself goes to /dev/null
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for line in sys.stdin:
        req = json.loads(line)
        res = {"id": req["id"]}
        o, e = io.StringIO(), io.StringIO()
        sys.stdout, sys.stderr = o, e
        saved_stdin = sys.stdin
        signal.alarm(int(req.get("limit", CASE_LIMIT_S)))
        try:
            if req.get("api") is not None:
                res.update(_run_api(req, state, api, MlxspecError))
            else:
                stdin = base64.b64decode(req["stdin"]) if req.get("stdin") is not None else b""
                sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
                try:
                    rc = cli.main(req["argv"])
                except SystemExit as se:
                    rc = se.code if isinstance(se.code, int) else 1
                res["rc"] = rc
        except _Timeout:
            res["exc"] = "hang"
        except MemoryError:
            res["exc"] = "oom"
        except BaseException as ex:  # noqa: BLE001 - classify every escape
            import traceback

            res["exc"] = "traceback"
            res["detail"] = f"{type(ex).__name__}: {str(ex)[:300]} @ " + traceback.format_tb(ex.__traceback__)[-1].strip()[:300]
        finally:
            signal.alarm(0)
            sys.stdin = saved_stdin
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        res["stdout"], res["stderr"] = o.getvalue()[-4000:], e.getvalue()[-4000:]
        out.write(json.dumps(res) + "\n")
        out.flush()


def _run_api(req, state, api, MlxspecError):
    from mlxspec.targets.load import load_target

    if "target" not in state:
        state["target"] = load_target(req["target"])
    target, tok = state["target"]
    a = req["api"]
    try:
        if "loadfull" in a:
            api.load(**a["loadfull"], log=io.StringIO())
            return {"rc": 0}
        if "load" in a:
            kw = dict(a["load"])
            spec_type = kw.pop("spec_type", "auto")
            api.load_speculator(req["drafter"], target, spec_type=spec_type, log=io.StringIO(), **kw)
            return {"rc": 0}
        kw = {"prompt": PROMPT, "max_tokens": int(MAX_TOKENS), **a["kwargs"]}
        prompt = kw.pop("prompt")
        text = api.generate(target, tok, prompt, **kw)
        print(text)
        return {"rc": 0}
    except MlxspecError as e:
        if not isinstance(e, ValueError):
            return {"exc": "traceback", "detail": "MlxspecError is not a ValueError"}
        print(f"mlxspec: error: {e}", file=sys.stderr)
        return {"rc": 2}


# ============================================================================ runner

class Runner:
    def __init__(self, env=None, limit_s: float = CASE_LIMIT_S):
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("HF_HUB_OFFLINE", "1")
        self.env["TOKENIZERS_PARALLELISM"] = "false"
        self.env["PYTHONPATH"] = ROOT + os.pathsep + self.env.get("PYTHONPATH", "")
        self.limit = limit_s
        self.proc = None

    def _start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.path.insert(0, %r); import fuzz_harness; "
                                      "fuzz_harness._worker_main()" % HERE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env, cwd=ROOT,
                                     text=True, bufsize=1)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def run(self, req: dict, first: bool = False) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
            first = True
        limit = self.limit + (120 if first else 0)  # the first case pays for importing mlx
        req = {**req, "limit": int(limit)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        deadline = time.time() + limit + 10
        while True:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.time()))
            if r:
                line = self.proc.stdout.readline()
                if line:
                    return json.loads(line)
                rc = self.proc.wait()
                self.proc = None
                sig = -rc if rc < 0 else None
                return {"exc": "oom" if sig == signal.SIGKILL else "crash",
                        "detail": f"worker died ({signal.Signals(sig).name if sig else f'exit {rc}'})"}
            if time.time() >= deadline:
                self.stop()
                return {"exc": "hang", "detail": f"no answer in {limit:.0f} s"}


def classify(case: Case, res: dict, baseline: str) -> tuple[str, str]:
    if res.get("exc"):
        return res["exc"], res.get("detail", "")
    rc, err, out = res.get("rc"), res.get("stderr", ""), res.get("stdout", "")
    errs = [ln for ln in err.splitlines() if ln.startswith("mlxspec: error:")]
    if "Traceback" in err:
        return "traceback", err[-300:]
    if rc == 2:
        msg = errs[-1] if errs else err.strip()[-200:]
        if len(errs) != 1 or not err.rstrip().endswith(errs[0]):
            return "bad-error", err.strip()[-300:]
        if case.expect == "ok" or (case.expect == "same" and case.group == "flags"):
            return "refused", msg
        if case.mention and case.mention not in msg:
            return "misleading", f"does not name {case.mention!r}: {msg}"
        return "error", msg
    if rc == 0:
        if case.expect == "run-or-error":
            return "ok", ""
        if case.expect == "error":
            return "accepted", out.strip()[:100]
        if case.expect == "ok":
            return "ok", ""
        return ("same", "") if out == baseline else ("wrong", f"{out.strip()[:60]!r} != {baseline.strip()[:60]!r}")
    return "bad-exit", f"exit {rc}: {err.strip()[-200:]}"


def run_cases(n: int, seed: int, workdir: str, log=None, limit_s: float = CASE_LIMIT_S, groups=None):
    """-> (results [(case, verdict, detail, seconds)], baseline stdout). groups: only these."""
    fx = Fixtures(os.path.join(workdir, "fixtures"))
    runner = Runner(limit_s=limit_s)
    try:
        cases = all_cases(fx, n, seed)
        if groups:
            cases = [c for c in cases if c.group in groups]
        base = runner.run({"id": "baseline", "argv": fx.base_argv()}, first=True)
        if base.get("rc") != 0:
            raise RuntimeError(f"baseline run failed: {base}")
        baseline = base["stdout"]
        results = []
        for i, case in enumerate(cases):
            d = os.path.join(workdir, f"case{i}")
            os.makedirs(d, exist_ok=True)
            subs = case.build(d) if case.build else {}
            argv = [subs.get(a, a) for a in case.argv]
            req = {"id": case.id, "argv": argv,
                   "stdin": base64.b64encode(case.stdin).decode() if case.stdin is not None else None}
            if case.api is not None:
                req.update(api=case.api, target=fx.target, drafter=fx.drafter)
            t0 = time.time()
            res = runner.run(req)
            verdict, detail = classify(case, res, baseline)
            if case.expect == "same-or-error" and verdict == "wrong":
                verdict = "same"  # a requantized tensor legitimately changes the numbers
            results.append((case, verdict, detail, time.time() - t0))
            if log:
                print(f"{i:4d} {verdict:10s} {case.group:12s} {case.id[:60]:60s} {detail[:120]}", file=log, flush=True)
            shutil.rmtree(d, ignore_errors=True)
        return results, baseline
    finally:
        runner.stop()
        fx.close()


def verdict_table(results) -> str:
    groups = sorted({c.group for c, *_ in results})
    verdicts = sorted({v for _, v, *_ in results}, key=lambda v: (v not in GOOD, v))
    lines = [f"{'group':14s}" + "".join(f"{v:>11s}" for v in verdicts) + f"{'total':>8s}"]
    for g in groups + ["all"]:
        rows = [r for r in results if g == "all" or r[0].group == g]
        lines.append(f"{g:14s}" + "".join(f"{sum(1 for r in rows if r[1] == v):11d}" for v in verdicts)
                     + f"{len(rows):8d}")
    return "\n".join(lines)

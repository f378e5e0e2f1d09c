"""Validation at the place a value enters: file metadata, config files, flags, API arguments.

Every check raises `MlxspecError` (a ValueError) with one line naming the value, what is
wrong and what to do. The loaders, the CLI and the API call these helpers rather than
converting with bare int()/float().
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import stat
import struct
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxspec.errors import MlxspecError

_MISSING = object()

# Sanity bounds for model dimensions read from files (far above any real model, far below
# what would exhaust memory just to build the module tree).
MAX_LAYERS = 1024
MAX_DIM = 1 << 20  # hidden / intermediate sizes, head counts, head dims
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 31
MAX_BLOCK = 256  # drafter block size


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _range(lo, hi, lo_open=False, hi_open=False) -> str:
    if lo is None and hi is None:
        return ""
    if lo is None:
        return f" {'<' if hi_open else '<='} {hi}"
    if hi is None:
        return f" {'>' if lo_open else '>='} {lo}"
    return f" in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def _in_range(v, lo, hi, lo_open=False, hi_open=False) -> bool:
    if lo is not None and (v < lo or (lo_open and v == lo)):
        return False
    if hi is not None and (v > hi or (hi_open and v == hi)):
        return False
    return True


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


# ------------------------------------------------------------------ values from files

def _value(d: dict, key: str, where: str, default, fix: str):
    """d[key]; _MISSING when it is absent or null and a default applies; one line when it is required."""
    v = d.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise MlxspecError(f"{where}: key {key} is missing; {fix}")
        return _MISSING
    return v


def get_int(d: dict, key: str, where: str, lo: int | None = 0, hi: int | None = None, default=_MISSING,
            fix: str = "the file is corrupt or not a supported model", integral_float: bool = False) -> int:
    """An integer from a metadata / config mapping, type- and range-checked.

    `integral_float`: accept 8.0 for 8 (JSON writers sometimes emit floats); 8.5 is refused."""
    if not isinstance(d, dict):
        raise MlxspecError(f"{where}: expected a key/value object, got {type(d).__name__}; {fix}")
    v = _value(d, key, where, default, fix)
    if v is _MISSING:
        return default
    if integral_float and isinstance(v, float) and math.isfinite(v) and v == int(v):
        v = int(v)
    if not _is_int(v):
        raise MlxspecError(f"{where}: {key} is {_show(v)} ({type(v).__name__}), expected an integer"
                           f"{_range(lo, hi)}; {fix}")
    if not _in_range(v, lo, hi):
        raise MlxspecError(f"{where}: {key} is {v}, expected an integer{_range(lo, hi)}; {fix}")
    return v


def get_float(d: dict, key: str, where: str, lo: float | None = None, hi: float | None = None,
              default=_MISSING, lo_open: bool = False, hi_open: bool = False,
              fix: str = "the file is corrupt or not a supported model") -> float:
    """A finite number from a metadata / config mapping, type- and range-checked."""
    if not isinstance(d, dict):
        raise MlxspecError(f"{where}: expected a key/value object, got {type(d).__name__}; {fix}")
    v = _value(d, key, where, default, fix)
    if v is _MISSING:
        return default
    if not _is_num(v):
        raise MlxspecError(f"{where}: {key} is {_show(v)} ({type(v).__name__}), expected a number"
                           f"{_range(lo, hi, lo_open, hi_open)}; {fix}")
    v = float(v)
    if not math.isfinite(v) or not _in_range(v, lo, hi, lo_open, hi_open):
        raise MlxspecError(f"{where}: {key} is {v}, expected a finite number{_range(lo, hi, lo_open, hi_open)}; {fix}")
    return v


def get_str(d: dict, key: str, where: str, default=_MISSING, choices=None,
            fix: str = "the file is corrupt or not a supported model") -> str:
    v = _value(d, key, where, default, fix)
    if v is _MISSING:
        return default
    if not isinstance(v, str):
        raise MlxspecError(f"{where}: {key} is {_show(v)} ({type(v).__name__}), expected a string; {fix}")
    if choices is not None and v not in choices:
        raise MlxspecError(f"{where}: {key} is {v!r}, expected one of {', '.join(map(str, choices))}; {fix}")
    return v


def get_bool(d: dict, key: str, where: str, default=_MISSING,
             fix: str = "the file is corrupt or not a supported model") -> bool:
    v = _value(d, key, where, default, fix)
    if v is _MISSING:
        return default
    if not isinstance(v, bool):
        raise MlxspecError(f"{where}: {key} is {_show(v)} ({type(v).__name__}), expected true or false; {fix}")
    return v


def get_int_list(d: dict, key: str, where: str, lo: int | None = 0, hi: int | None = None, default=_MISSING,
                 unique: bool = False, min_len: int = 0, integral_float: bool = False,
                 fix: str = "the file is corrupt or not a supported model") -> list[int]:
    """A list of integers (each range-checked; optionally unique)."""
    v = _value(d, key, where, default, fix)
    if v is _MISSING:
        return default
    if hasattr(v, "tolist") and not isinstance(v, (list, tuple)):
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise MlxspecError(f"{where}: {key} is {_show(v)} ({type(v).__name__}), expected a list of integers; {fix}")
    out = []
    for x in v:
        if integral_float and isinstance(x, float) and math.isfinite(x) and x == int(x):
            x = int(x)
        if not _is_int(x) or not _in_range(x, lo, hi):
            raise MlxspecError(f"{where}: {key} holds {_show(x)}, expected integers{_range(lo, hi)}; {fix}")
        out.append(x)
    if len(out) < min_len:
        raise MlxspecError(f"{where}: {key} has {len(out)} entries, expected at least {min_len}; {fix}")
    if unique and len(set(out)) != len(out):
        dup = sorted({x for x in out if out.count(x) > 1})
        raise MlxspecError(f"{where}: {key} repeats {', '.join(map(str, dup))}; every entry must be distinct; {fix}")
    return out


# ------------------------------------------------------------------ flags and API arguments

def check_int_arg(name: str, v, lo: int | None = None, hi: int | None = None, allow_none: bool = False) -> int | None:
    """A flag / API integer argument: an int (not a bool) in range."""
    if v is None and allow_none:
        return None
    if not _is_int(v) or not _in_range(v, lo, hi):
        raise MlxspecError(f"{name} {_show(v)} is out of range: pass an integer{_range(lo, hi)}")
    return v


def check_float_arg(name: str, v, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                    hi_open: bool = False, allow_none: bool = False) -> float | None:
    """A flag / API number argument: finite and in range."""
    if v is None and allow_none:
        return None
    if not _is_num(v) or not math.isfinite(float(v)) or not _in_range(float(v), lo, hi, lo_open, hi_open):
        raise MlxspecError(f"{name} {_show(v)} is out of range: pass a finite number{_range(lo, hi, lo_open, hi_open)}")
    return float(v)


def parse_float_list(name: str, text, example: str) -> list[float]:
    """A flag holding comma-separated numbers ("0,0.7") -> finite floats; empty entries are
    skipped, an empty list or a word or NaN is one line naming the flag and an example."""
    try:
        out = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        out = None
    if not out or not all(math.isfinite(x) for x in out):
        raise MlxspecError(f"{name} {str(text)!r}: expected comma-separated numbers, e.g. {example}")
    return out


def check_sampling_args(max_tokens, temp, top_p, top_k, seed) -> None:
    """The generation arguments shared by the CLI and the API."""
    check_int_arg("max_tokens (--max-tokens)", max_tokens, 1)
    check_float_arg("temp (--temp)", temp, 0.0)
    check_float_arg("top_p (--top-p)", top_p, 0.0, 1.0, lo_open=True)
    check_int_arg("top_k (--top-k)", top_k, 0)
    check_int_arg("seed (--seed)", seed, 0, (1 << 63) - 1, allow_none=True)


def check_spec_args(block_size, num_draft_tokens, p_min) -> None:
    """The speculation arguments shared by the CLI and the API."""
    check_int_arg("block_size (--block-size)", block_size, 1, MAX_BLOCK, allow_none=True)
    check_int_arg("num_draft_tokens (--num-draft-tokens)", num_draft_tokens, 1, MAX_BLOCK, allow_none=True)
    check_float_arg("p_min (--p-min)", p_min, 0.0, 1.0, allow_none=True)


def check_prompt_ids(ids, vocab_size: int, context: int | None, max_tokens: int) -> list[int]:
    """Token ids inside the vocabulary; prompt + max_tokens inside the context window."""
    out = []
    for t in ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise MlxspecError(f"prompt token id {_show(t)} is outside the vocabulary [0, {vocab_size}); "
                               "pass ids from this model's tokenizer")
        out.append(int(t))
    if not out:
        raise MlxspecError("the prompt is empty; pass some text with --prompt")
    if context and len(out) + max_tokens > context:
        raise MlxspecError(f"the prompt ({len(out)} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                           f"context length ({context} tokens); shorten the prompt or lower --max-tokens")
    return out


def check_text(name: str, text: str) -> str:
    """A text flag / API string (prompt, system prompt, stop string) that must be Unicode text.

    Python hands undecodable argv bytes over as lone surrogates (surrogateescape): `--prompt
    $'abc\\xff'` is 'abc\\udcff'. Such text is refused, never repaired: replacing the bytes
    would run a prompt the user did not write."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        if 0xDC80 <= c <= 0xDCFF:  # an undecodable byte, as surrogateescape keeps it
            at = len(text[:e.start].encode("utf-8", "surrogateescape"))
            why = f"invalid byte 0x{c - 0xDC00:02x} at offset {at}"
        else:
            why = f"lone surrogate U+{c:04X} at character {e.start}"
        raise MlxspecError(f"{name} is not UTF-8 text ({why}); pass the text as UTF-8") from None
    return text


# ------------------------------------------------------------------ output paths

_WRITE_ERRORS = {
    errno.ENOSPC: ("no space left on the device", "free some space or pass a path on another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free some space or pass a path on another disk"),
    errno.EFBIG: ("file too large for the file system", "pass a path on another file system"),
    errno.EROFS: ("read-only file system", "pass a directory you can write to"),
    errno.EACCES: ("permission denied", "pass a directory you can write to"),
    errno.EPERM: ("operation not permitted", "pass a directory you can write to"),
    errno.ENOTDIR: ("a part of the path is not a directory", "pass a path inside a directory"),
}


def _nearest_existing(p: Path) -> Path:
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _read_only(d: Path) -> bool:
    try:
        return bool(os.statvfs(d).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _writable_base(flag: str, path, base: Path) -> None:
    if not base.is_dir():
        raise MlxspecError(f"{flag} {path}: {base} is not a directory; pass a path inside a directory")
    if _read_only(base) or not os.access(base, os.W_OK | os.X_OK):
        why = "read-only file system" if _read_only(base) else "permission denied"
        raise MlxspecError(f"{flag} {path}: cannot write into {base} ({why}); pass a directory you can write to")


def check_output_dir(flag: str, path) -> Path:
    """An output directory (`convert --out`, `bench --out`, `train --out`), checked before any
    work: not an existing file, and the directory itself or, when it does not exist yet, its
    nearest existing parent (missing parents are created, as `mkdir -p`) a directory this
    process can write into. Failures while writing: `writing()`."""
    if not str(path).strip():
        raise MlxspecError(f"{flag} is empty: pass a directory")
    p = Path(os.fspath(path))
    if p.exists() and not p.is_dir():
        raise MlxspecError(f"{flag} {path}: exists and is not a directory; pass a new directory")
    _writable_base(flag, path, _nearest_existing(p))
    return p


def check_output_file(flag: str, path) -> Path:
    """An output file (a drafter .gguf): not a directory or a special file, and its directory
    (created when missing) writable."""
    if not str(path).strip():
        raise MlxspecError(f"{flag} is empty: pass a file name")
    p = Path(os.fspath(path))
    if p.is_dir():
        raise MlxspecError(f"{flag} {path}: is a directory; pass a file name")
    if os.path.lexists(p) and not (p.is_file() or p.is_symlink()):
        raise MlxspecError(f"{flag} {path}: not a regular file (FIFO, socket or device); pass a file name")
    _writable_base(flag, path, _nearest_existing(p.parent))
    return p


def check_free_space(flag: str, path, need_bytes: int) -> None:
    """Refuse before writing when the output's file system has less than `need_bytes` free."""
    base = _nearest_existing(Path(os.fspath(path)))
    try:
        st = os.statvfs(base)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < need_bytes:
        raise MlxspecError(f"{flag} {path}: needs {need_bytes / 1e6:,.1f} MB but {base} has {free / 1e6:,.1f} MB "
                           "free; free some space or pass a path on another disk")


@contextmanager
def writing(flag: str, path):
    """The writes of one output: an OSError (or MLX's RuntimeError from its own file writer,
    which carries no errno) becomes one line naming the output, the cause and the fix."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOMEM:  # mmap or a buffer the kernel would not give: memory, not the disk
            raise MlxspecError(out_of_memory(f"{flag} {path}")) from None
        raise MlxspecError(_write_error(flag, path, e.errno, e.strerror, e.filename)) from None
    except MemoryError:
        raise MlxspecError(out_of_memory(f"{flag} {path}")) from None
    except RuntimeError as e:
        msg = str(e)
        if msg.startswith("[malloc") or "Unable to allocate" in msg:  # MLX's allocator
            raise MlxspecError(out_of_memory(f"{flag} {path}")) from None
        if not msg.startswith(("[write]", "[save", "[open]")) and "Failed to open file" not in msg:
            raise
        base = _nearest_existing(Path(os.fspath(path)))
        try:
            full = os.statvfs(base).f_bavail == 0
        except OSError:
            full = False
        code = (errno.ENOSPC if full else errno.EROFS if _read_only(base)
                else errno.EACCES if not os.access(base, os.W_OK) else None)
        raise MlxspecError(_write_error(flag, path, code, msg.strip(), None)) from None


def out_of_memory(what: str) -> str:
    """The line for memory exhaustion while producing `what` (ENOMEM, MemoryError): the process
    ran out of memory (or hit its address-space limit), which no change of path or disk fixes."""
    return (f"{what}: out of memory (the process could not allocate more; not a disk problem); free memory, "
            "raise the process's memory limit (ulimit -v) or lower the sizes of the run")


def _write_error(flag: str, path, code, strerror, filename) -> str:
    why, fix = _WRITE_ERRORS.get(code, (strerror or "write failed", "check the path and the disk"))
    what = f" ({filename})" if filename and os.fspath(filename) != os.fspath(path) else ""
    return f"{flag} {path}: cannot write{what}: {why}; {fix}"


# ------------------------------------------------------------------ files

def require_regular_file(path: str | os.PathLike, what: str = "file") -> None:
    """Refuse FIFOs, sockets, devices (opening a FIFO blocks forever) and missing paths.
    Symlinks to regular files are fine."""
    p = os.fspath(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise MlxspecError(f"{p}: no such file; check the path") from None
    except OSError as e:
        raise MlxspecError(f"{p}: cannot read the {what}: {e.strerror}; check the path and permissions") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file (FIFO, socket or device)"
        raise MlxspecError(f"{p}: {kind}; pass a regular {what}")


def read_json_object(path: str | os.PathLike, what: str = "config.json") -> dict:
    """A JSON file that must hold an object; one-line errors for every way it can fail."""
    require_regular_file(path, what)
    try:
        with open(path, "rb") as f:
            data = f.read()
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise MlxspecError(f"{path}: not UTF-8 text; the {what} is corrupt") from None
    except (ValueError, RecursionError) as e:
        raise MlxspecError(f"{path}: invalid JSON ({str(e).splitlines()[0][:80]}); the {what} is corrupt") from None
    except OSError as e:
        raise MlxspecError(f"{path}: cannot read the {what}: {e.strerror}") from None
    if not isinstance(obj, dict):
        raise MlxspecError(f"{path}: holds a JSON {type(obj).__name__}, expected an object; the {what} is corrupt")
    return obj


def is_power_of_two(n: int) -> bool:
    return _is_int(n) and n > 0 and (n & (n - 1)) == 0


def check_finite_weights(arrays: dict, where: str) -> None:
    """Refuse NaN / Inf in floating-point weights (they make every probability NaN)."""
    for name, a in arrays.items():
        if isinstance(a, mx.array):
            ok = not mx.issubdtype(a.dtype, mx.floating) or bool(mx.all(mx.isfinite(a)).item())
        else:
            arr = np.asarray(a)
            ok = not np.issubdtype(arr.dtype, np.floating) or bool(np.isfinite(arr).all())
        if not ok:
            raise MlxspecError(f"{where}: tensor {name} holds NaN or Inf values; the weights are corrupt, re-export them")


# ------------------------------------------------------------------ values already looked up

def as_int(v, key: str, where: str, lo: int | None = 0, hi: int | None = None, **kw) -> int:
    """`get_int` for a value already looked up (None = missing)."""
    return get_int({key: v}, key, where, lo, hi, **kw)


def as_float(v, key: str, where: str, lo: float | None = None, hi: float | None = None, **kw) -> float:
    return get_float({key: v}, key, where, lo, hi, **kw)


def as_int_list(v, key: str, where: str, lo: int | None = 0, hi: int | None = None, **kw) -> list[int]:
    return get_int_list({key: v}, key, where, lo, hi, **kw)


_ST_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_safetensors(path: str | os.PathLike) -> None:
    """Validate a safetensors file's header against the file before any tensor is read:
    a JSON object within the file, known dtypes, shapes of non-negative integers, byte
    ranges that match dtype x shape and tile the data section exactly (no overlaps, gaps
    or out-of-file ranges)."""
    p = os.fspath(path)
    require_regular_file(p, "safetensors file")
    size = os.path.getsize(p)
    fix = "the safetensors file is corrupt, download or export it again"
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MlxspecError(f"{p}: {size} bytes, too short for a safetensors header; {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise MlxspecError(f"{p}: header length {n} does not fit the {size}-byte file; {fix}")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise MlxspecError(f"{p}: the header is not valid JSON; {fix}") from None
    if not isinstance(header, dict):
        raise MlxspecError(f"{p}: the header is not a JSON object; {fix}")
    ranges = []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(e, dict) and e.get("dtype") in _ST_SIZES and isinstance(e.get("shape"), list)
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(_is_int(x) and x >= 0 for x in e["shape"] + e["data_offsets"])):
            raise MlxspecError(f"{p}: tensor {name}: malformed entry {_show(e)}; {fix}")
        b, end = e["data_offsets"]
        n_el = 1
        for d in e["shape"]:
            n_el *= d
        if end < b or end - b != n_el * _ST_SIZES[e["dtype"]]:
            raise MlxspecError(f"{p}: tensor {name} ({e['dtype']} {e['shape']}) spans bytes {b}..{end}, "
                               f"expected {n_el * _ST_SIZES[e['dtype']]} bytes; {fix}")
        ranges.append((b, end, name))
    ranges.sort()
    pos = 0
    for b, end, name in ranges:
        if b != pos:
            raise MlxspecError(f"{p}: tensor {name} starts at data byte {b}, expected {pos} "
                               f"({'overlapping' if b < pos else 'a gap between'} tensors); {fix}")
        pos = end
    if 8 + n + pos != size:
        raise MlxspecError(f"{p}: the tensors end at byte {8 + n + pos} but the file has {size} bytes "
                           f"({'truncated' if 8 + n + pos > size else 'trailing data'}); {fix}")

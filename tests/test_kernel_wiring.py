"""The custom kernels wired into the GGUF target loader and the DSpark drafter.

Without a GPU the kernels' own backend is the MLX reference; the tests force the *wiring*
decision (the loader's backend check, the drafter's `kernels` module) so the native paths run
here: `NativeLowBitLinear` calls `kernels.lowbit_matmul` (reference: lossless repack +
quantized_matmul) and the drafter calls `kernels.markov_chain` (reference: MLX loop). They are
compared with the paths used without a kernel: the load-time repack and the per-position
Markov loop.

GGUF files are written here with the `gguf` package; type ids the package's enum may lack
(Q2_0 42, PQ2_0 142, PTQ1_0 143) are written under a placeholder type and patched in the
tensor-info table afterwards (as tests/conftest.py does).
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxspec import kernels
from mlxspec.gguf import quants as lowbit
from mlxspec.targets import gguf as gguf_target
from mlxspec.drafters.config import DrafterConfig
from mlxspec.drafters.model import DFlashModel
from mlxspec.targets.lowbit_linear import NativeLowBitLinear
from mlxspec.targets.model import Target, dequantize_model
from mlxspec.engine import drafting as drafters
from mlxspec.engine.drafting import BlockDrafter
from mlxspec.engine.verify import SamplingParams, probs_from_logits

# ----------------------------------------------------------------------------- a tiny low-bit GGUF

H, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 384, 4, 2, 2, 300
TYPES = {  # per layer: every low-bit type, on Q/K (row-permuted) and plain matrices
    "attn_q": lowbit.Q1_0, "attn_k": lowbit.Q2_0, "attn_v": lowbit.PQ2_0, "attn_output": lowbit.PTQ1_0,
    "ffn_gate": lowbit.Q1_0, "ffn_up": lowbit.Q2_0, "ffn_down": lowbit.PTQ1_0,
}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}


def _patch_type_ids(path, patch: dict) -> None:
    data = bytearray(open(path, "rb").read())
    for name, tid in patch.items():
        key = struct.pack("<Q", len(name)) + name.encode()
        pos = data.find(key)
        assert pos > 0, name
        pos += len(key)
        assert struct.unpack_from("<I", data, pos)[0] == 2, name  # n_dims
        pos += 4 + 8 * 2
        data[pos:pos + 4] = struct.pack("<I", tid)
    open(path, "wb").write(bytes(data))


def write_lowbit_llama(path, seed: int = 0) -> dict:
    """A 2-layer llama whose Linear weights (and lm_head, Q1_0) are PrismML low-bit types.
    -> {gguf name: (type id, raw uint8 [rows, row bytes])} of the low-bit tensors."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    hd = H // HEADS
    shapes = {"attn_q": (HEADS * hd, H), "attn_k": (KV_HEADS * hd, H), "attn_v": (KV_HEADS * hd, H),
              "attn_output": (H, HEADS * hd), "ffn_gate": (FFN, H), "ffn_up": (FFN, H), "ffn_down": (H, FFN)}
    written, patch = {}, {}

    def add_lowbit(name, tid, shape):
        raw = lowbit.quantize(tid, rng.standard_normal(shape).astype(np.float32) * 0.08)
        w.add_tensor(name, raw.view(np.int8), raw_shape=shape, raw_dtype=gguf.GGMLQuantizationType.F32)
        written[name], patch[name] = (tid, raw), tid

    w.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, H)) * 0.5).astype(np.float32))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        for part, tid in TYPES.items():
            add_lowbit(f"blk.{i}.{part}.weight", tid, shapes[part])
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    add_lowbit("output.weight", lowbit.Q1_0, (VOCAB, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _patch_type_ids(path, patch)
    return written


@pytest.fixture(scope="module")
def lowbit_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("wiring") / "lowbit.gguf"
    return path, write_lowbit_llama(path)


def _force_gpu_backend(monkeypatch):
    """The loader believes a GPU kernel backend is present; the kernel itself still runs its
    MLX reference (kernels.backend() is untouched)."""
    monkeypatch.setattr(gguf_target, "_kernel_backend", lambda: "metal")
    monkeypatch.delenv(gguf_target.NATIVE_ENV, raising=False)


def _float32(model):
    model.apply(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)
    mx.eval(model.parameters())
    return model


def _logits(model, tokens) -> np.ndarray:
    target = Target(model, {"hidden_size": H, "model_type": "llama"})
    out, _ = target(mx.array([tokens]), target.make_cache())
    return np.array(out.astype(mx.float32))


TOKENS = [1, 17, 250, 3, 99, 42, 7, 123, 5, 299, 64, 0]


def _layers(model):
    return [(f"model.layers.{i}.{HF[p]}", p) for i in range(LAYERS) for p in TYPES]


def _module(model, path):
    return gguf_target._module_at(model, path)


# ----------------------------------------------------------------------------- loader

def test_native_choice(monkeypatch):
    """Automatic on metal/cuda, off on the reference backend and with MLXSPEC_NATIVE_LOWBIT=0;
    an explicit argument wins."""
    monkeypatch.delenv(gguf_target.NATIVE_ENV, raising=False)
    assert kernels.backend() == "reference"  # this machine: no GPU
    assert not gguf_target.native_lowbit_enabled()
    assert gguf_target.native_lowbit_enabled(True)
    for b in ("metal", "cuda"):
        monkeypatch.setattr(gguf_target, "_kernel_backend", lambda b=b: b)
        assert gguf_target.native_lowbit_enabled()
        assert not gguf_target.native_lowbit_enabled(False)
        monkeypatch.setenv(gguf_target.NATIVE_ENV, "0")
        assert not gguf_target.native_lowbit_enabled()
        monkeypatch.delenv(gguf_target.NATIVE_ENV)


def test_native_and_repack_give_the_same_logits(lowbit_gguf, monkeypatch):
    path, written = lowbit_gguf
    repack, cfg, _, notes_r = gguf_target.load_gguf_target(str(path))  # CPU: reference -> repack
    _force_gpu_backend(monkeypatch)
    native, _, _, notes_n = gguf_target.load_gguf_target(str(path))

    for prefix, part in _layers(native):
        m, r = _module(native, prefix), _module(repack, prefix)
        assert isinstance(m, NativeLowBitLinear) and m.type_id == TYPES[part], prefix
        assert isinstance(r, nn.QuantizedLinear), prefix
        # the weight is the file's bytes (Q/K rows unpermuted, whole rows move)
        tid, raw = written[f"blk.{prefix.split('.')[2]}.{part}.weight"]
        got = np.array(m.weight)
        if part in ("attn_q", "attn_k"):
            n_head = HEADS if part == "attn_q" else KV_HEADS
            raw = gguf_target._unpermute(raw, n_head)
        np.testing.assert_array_equal(got, raw, err_msg=prefix)
        # and dequantizes to exactly the repacked weight
        wr = mx.dequantize(r.weight, r.scales.astype(mx.float32), r.biases.astype(mx.float32), r.group_size, r.bits)
        np.testing.assert_array_equal(np.array(m.dense()), np.array(wr), err_msg=prefix)
    assert not isinstance(native.lm_head, NativeLowBitLinear)  # lm_head stays repacked (read as .weight)
    assert any("native" in n for n in notes_n) and not any("native" in n for n in notes_r)

    # as loaded (float16 activations): within float16 rounding
    a, b = _logits(native, TOKENS), _logits(repack, TOKENS)
    assert np.isfinite(a).all()
    assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max()
    # float32 activations: the same weights, the same math -> 1e-4 relative
    a, b = _logits(_float32(native), TOKENS), _logits(_float32(repack), TOKENS)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()


def test_env_zero_keeps_the_repack(lowbit_gguf, monkeypatch):
    path, _ = lowbit_gguf
    _force_gpu_backend(monkeypatch)
    monkeypatch.setenv(gguf_target.NATIVE_ENV, "0")
    model, *_ = gguf_target.load_gguf_target(str(path))
    assert not any(isinstance(m, NativeLowBitLinear) for _, m in model.named_modules())


def test_ptq1_0_is_repacked_bit_exact(lowbit_gguf):
    """PTQ1_0 loads as an MLX 2-bit affine layer (group 128) that dequantizes exactly to the
    llama.cpp values, not as float16."""
    path, written = lowbit_gguf
    model, _, _, notes = gguf_target.load_gguf_target(str(path), native_lowbit=False)
    for i in range(LAYERS):
        m = _module(model, f"model.layers.{i}.mlp.down_proj")
        assert isinstance(m, nn.QuantizedLinear) and (m.bits, m.group_size) == (2, 128)
        tid, raw = written[f"blk.{i}.ffn_down.weight"]
        assert tid == lowbit.PTQ1_0
        got = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits).astype(mx.float32)
        np.testing.assert_array_equal(np.array(got), lowbit.dequantize(tid, raw, (H, FFN)))
    assert not any("PTQ1_0" in n and "float16" in n for n in notes), notes


def test_dequantize_model_densifies_native_layers(lowbit_gguf, monkeypatch):
    """The dense-on-CPU path still works when a model has native low-bit layers."""
    path, _ = lowbit_gguf
    repack, *_ = gguf_target.load_gguf_target(str(path), native_lowbit=False)
    _force_gpu_backend(monkeypatch)
    native, *_ = gguf_target.load_gguf_target(str(path))
    dequantize_model(native, mx.float32)
    dequantize_model(repack, mx.float32)
    for prefix, _ in _layers(native):
        m, r = _module(native, prefix), _module(repack, prefix)
        assert type(m) is nn.Linear and m.weight.dtype == mx.float32, prefix
        np.testing.assert_array_equal(np.array(m.weight), np.array(r.weight), err_msg=prefix)
    np.testing.assert_allclose(_logits(native, TOKENS), _logits(repack, TOKENS), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- drafter

TV, TH = 512, 64


@pytest.fixture(scope="module")
def small_target():
    from mlx_lm.models import llama

    cfg = dict(model_type="llama", hidden_size=TH, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=TV,
               rope_theta=10000.0, tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.apply(lambda a: a.astype(mx.float32))
    mx.eval(model.parameters())
    return Target(model, cfg)


def make_drafter(target, kind="vanilla", rank=32, draft_vocab=None, seed=1) -> BlockDrafter:
    c = DrafterConfig(hidden_size=TH, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, block_size=8, target_layer_ids=[0, 1],
                      mask_token_id=TV - 1, vocab_size=TV, markov_rank=rank, markov_head_type=kind,
                      confidence_head=True, draft_vocab_size=draft_vocab, rope_theta=1e4,
                      sample_from_anchor=True)
    mx.random.seed(seed)
    m = DFlashModel(c)
    mh = m.markov_head  # a chain that matters: bias of the size of the base logits
    mh.markov_w1.weight = mx.random.normal(mh.markov_w1.weight.shape)
    mh.markov_w2.weight = mx.random.normal(mh.markov_w2.weight.shape) * rank ** -0.5
    if draft_vocab:
        ids = np.sort(np.random.default_rng(seed).choice(TV, draft_vocab, replace=False))
        m.d2t = mx.array(ids - np.arange(draft_vocab), dtype=mx.int32)
    mx.eval(m.parameters())
    d = BlockDrafter(m, target)
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    _, taps = target(mx.array([ids]), target.make_cache(), taps=d.taps)
    d.begin(ids, taps)
    return d


def _kernel_path(monkeypatch):
    """drafters sees a GPU backend; kernels.markov_chain itself runs its MLX reference."""
    calls = []

    def chain(*a, **k):
        calls.append(a)
        return kernels.markov_chain(*a, **k)

    monkeypatch.setattr(drafters, "kernels", SimpleNamespace(backend=lambda: "cuda", markov_chain=chain))
    return calls


def test_markov_kernel_path_greedy_matches_the_loop(small_target, monkeypatch):
    d = make_drafter(small_target)
    sp = SamplingParams()
    anchor = 77
    loop = d.draft(anchor, 7, sp, np.random.default_rng(0))
    calls = _kernel_path(monkeypatch)
    fast = d.draft(anchor, 7, sp, np.random.default_rng(0))
    assert len(calls) == 1
    assert fast.tokens == loop.tokens
    np.testing.assert_allclose(fast.confidence, loop.confidence, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(fast.logits), np.array(loop.logits), rtol=1e-5, atol=1e-4)
    # the chain changes the draft (else this test could not tell the paths apart)
    _, base = d.base_logits(anchor, 7)
    assert np.array(mx.argmax(base, axis=-1)).tolist() != loop.tokens


def test_markov_kernel_path_sampled(small_target, monkeypatch):
    """Sampling through the kernel: the tokens are the kernel's Gumbel-max draws for a key
    taken from rng, and the q rows are softmax(z_k / T) of the drawn chain."""
    d = make_drafter(small_target)
    sp = SamplingParams(temperature=0.8)
    anchor = 5
    calls = _kernel_path(monkeypatch)
    out = d.draft(anchor, 7, sp, np.random.default_rng(123))
    assert len(calls) == 1
    key = int(np.random.default_rng(123).integers(0, 1 << 62))
    h, base = d.base_logits(anchor, 7)
    mh = d.model.markov_head
    want, _ = kernels.markov_chain_reference(base, mh.markov_w1.weight, mh.markov_w2.weight, anchor, 0.8, key)
    assert out.tokens == np.array(want).tolist()
    prev = mx.array([anchor] + out.tokens[:-1])
    z = base + mh.bias(mh.state(prev))
    q = np.array(out.probs)
    np.testing.assert_allclose(q, np.array(probs_from_logits(z, sp)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    assert all(q[k, t] > 0 for k, t in enumerate(out.tokens))
    conf = d.model.confidence_head(h, mh.state(prev))
    np.testing.assert_allclose(out.confidence, np.array(conf), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["gated", "rnn", "draft_vocab", "rank_not_32", "top_p"])
def test_markov_loop_kept_where_the_kernel_does_not_apply(small_target, monkeypatch, case):
    kw = {"gated": dict(kind="gated"), "rnn": dict(kind="rnn"), "draft_vocab": dict(draft_vocab=256),
          "rank_not_32": dict(rank=24), "top_p": {}}[case]
    d = make_drafter(small_target, **kw)
    sp = SamplingParams(temperature=0.7, top_p=0.9) if case == "top_p" else SamplingParams()
    loop = d.draft(9, 7, sp, np.random.default_rng(0))
    calls = _kernel_path(monkeypatch)
    again = d.draft(9, 7, sp, np.random.default_rng(0))
    assert calls == []
    assert again.tokens == loop.tokens

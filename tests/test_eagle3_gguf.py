"""llama.cpp's EAGLE-3 GGUF drafters (issue 36, "Read"): `general.architecture = eagle3`.

`llama_cpp_gguf` writes a tiny drafter the way llama.cpp's converter does (convert_hf_to_gguf.py
run on a speculators directory with --target-model-dir): its architecture name and keys, the
tap ids as layer-INPUT ids under `eagle3.target_layers` (or the older `eagle3.extract_layers`),
`hidden_norm` as `blk.0.attn_norm_2`, q/k rows permuted for llama.cpp's RoPE, d2t as absolute
I64 target ids, t2d dropped. Read with `load_drafter`, it must draft exactly what the same
weights draft from the speculators directory; mlxspec's own writer must write the same file
content; and the errors a user can meet are one line naming the tensor or key.
"""

from __future__ import annotations

import io

import gguf
import mlx.core as mx
import numpy as np
import pytest
from conftest import llama_cpp_permute
from mlx.utils import tree_flatten
from test_eagle3 import GREEDY, eagle3_config, random_eagle3

from mlxspec.drafters.eagle3 import rope_inv_freq
from mlxspec.drafters.formats import gguf_eagle3
from mlxspec.drafters.load import load_drafter, save_drafter
from mlxspec.engine.eagle3 import Eagle3Drafter
from mlxspec.errors import MlxspecError
from mlxspec.gguf.file import read_gguf
from tiny_targets import tiny_target

# speculators tensor name -> llama.cpp name (the converter's tensor map for the eagle3 arch)
CONVERTER_NAMES = {
    "fc.weight": "fc.weight",
    "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
}


def llama_cpp_gguf(path, spec_dir, cfg, tap_key="eagle3.target_layers", drop=(), rename=None, meta=None,
                   d2t_type=None) -> str:
    """The GGUF llama.cpp's converter makes from the speculators directory `spec_dir`."""
    t = {k: np.array(v) for k, v in mx.load(str(spec_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])  # the target's tokenizer
    meta = {tap_key: [int(k) + 1 for k in cfg.target_layer_ids], "eagle3.target_hidden_size": cfg.target_hidden_size,
            "eagle3.norm_before_residual": bool(cfg.norm_before_residual), **(meta or {})}
    for k, v in meta.items():
        if v is None:
            continue
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        else:
            w.add_uint32(k, v)
    for name, a in t.items():
        if name == "t2d" or name in drop:
            continue
        if name == "d2t":
            ids = a.astype(np.int64) + np.arange(a.shape[0], dtype=np.int64)
            w.add_tensor("d2t", ids.astype(d2t_type or np.int64))
            continue
        out = CONVERTER_NAMES[name]
        if name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor((rename or {}).get(out, out), np.ascontiguousarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama", seed=0)


@pytest.fixture(scope="module")
def made(llama, tmp_path_factory):
    """(config, reference model, speculators directory): reduced vocabulary, norm_before_residual."""
    d = tmp_path_factory.mktemp("e3gguf")
    cfg = eagle3_config(draft_vocab_size=40, norm_before_residual=True)
    ref = random_eagle3(cfg, seed=3)
    save_drafter(ref, cfg, d / "spec", "speculators-eagle3", target=llama)
    return cfg, ref, d / "spec"


def load(path, target):
    log = io.StringIO()
    model, cfg = load_drafter(str(path), target.info, log=log)
    return model, cfg, log.getvalue()


def drafts(model, cfg, target, ids=(3, 9, 27, 1, 14), n=4):
    d = Eagle3Drafter(model, cfg, target)
    _, taps = target(mx.array([list(ids)]), target.make_cache(), taps=d.taps)
    d.begin(list(ids), taps)
    return d.draft(5, n, GREEDY, np.random.default_rng(0))


# ----------------------------------------------------------------------------- reading

@pytest.mark.parametrize("tap_key", ["eagle3.target_layers", "eagle3.extract_layers"])
def test_converted_gguf_drafts_as_the_speculators_directory(llama, made, tmp_path, tap_key):
    """Taps 2,3,4 (layer inputs) are the outputs of layers 1,2,3 ... of 0,1,2 here: read once,
    as mlxspec's taps; weights (q/k un-permuted, d2t back to offsets) equal; drafts and logits
    equal those of the speculators directory."""
    cfg, ref, spec = made
    path = llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg, tap_key=tap_key)
    model, got, line = load(path, llama)
    assert got.target_layer_ids == (0, 1, 2) and got.file_layer_ids == (1, 2, 3)
    assert got.tap_convention == "llama.cpp" and got.source_format == "gguf-eagle3"
    assert got.draft_vocab_size == 40 and got.vocab_size == 64 and got.norm_before_residual
    assert not got.has_embed and got.has_lm_head
    params = dict(tree_flatten(model.parameters()))
    for k, v in tree_flatten(ref.parameters()):
        assert mx.array_equal(params[k], v), k
    assert line.strip() == (
        "mlxspec: drafter lineage=eagle3 taps=0,1,2 (output of layer) file_ids=1,2,3 (llama.cpp) "
        "taps_from=file (llama.cpp ids) layers=1 draft_vocab=40/64 max_drafts=7 norm_before_residual=true "
        "format=gguf-eagle3")
    spec_model, spec_cfg, _ = load(spec, llama)
    a, b = drafts(model, got, llama), drafts(spec_model, spec_cfg, llama)
    assert a.tokens == b.tokens and mx.array_equal(a.logits, b.logits)


def test_mlxspec_writes_what_the_converter_writes(llama, made, tmp_path):
    """save_drafter(..., "gguf-eagle3"): the converter's tensors byte for byte (names, ggml
    types, data), its keys (both tap spellings), and it reads back to the same weights."""
    cfg, ref, spec = made
    conv = read_gguf(llama_cpp_gguf(tmp_path / "conv.gguf", spec, cfg))
    save_drafter(ref, cfg, tmp_path / "ours.gguf", "gguf-eagle3", target=llama)
    ours = read_gguf(tmp_path / "ours.gguf")
    assert ours.architecture == "eagle3"
    assert {t.name for t in ours.tensors} == {t.name for t in conv.tensors}
    cmap = conv.tensor_map()
    for t in ours.tensors:
        c = cmap[t.name]
        assert (t.type_id, t.shape) == (c.type_id, c.shape), t.name
        assert np.array_equal(ours.raw(t), conv.raw(c)), t.name
    for k in ("eagle3.target_layers", "eagle3.extract_layers"):
        assert list(ours.metadata[k]) == [1, 2, 3]
    for k in ("eagle3.target_hidden_size", "eagle3.norm_before_residual", "eagle3.embedding_length",
              "eagle3.block_count", "eagle3.attention.head_count_kv", "eagle3.vocab_size"):
        assert ours.metadata[k] == conv.metadata[k], k
    model, got, _ = load(tmp_path / "ours.gguf", llama)
    assert got.target_layer_ids == (0, 1, 2)
    params = dict(tree_flatten(model.parameters()))
    for k, v in tree_flatten(ref.parameters()):
        assert mx.array_equal(params[k], v), k


def test_full_vocabulary_and_own_embedding(llama, tmp_path):
    """No d2t (the draft vocabulary is the target's) and a token_embd of its own: read and used."""
    cfg = eagle3_config()
    ref = random_eagle3(cfg, seed=4)
    save_drafter(ref, cfg, tmp_path / "spec", "speculators-eagle3", target=llama, with_embed=True)
    path = llama_cpp_gguf(tmp_path / "d.gguf", tmp_path / "spec", cfg)
    assert "d2t" not in read_gguf(path).tensor_map()
    model, got, _ = load(path, llama)
    assert got.has_embed and not got.reduced_vocab
    assert mx.array_equal(model.embed_tokens.weight, llama.inner.embed_tokens.weight)
    spec_model, spec_cfg, _ = load(tmp_path / "spec", llama)
    a, b = drafts(model, got, llama), drafts(spec_model, spec_cfg, llama)
    assert a.tokens == b.tokens and mx.array_equal(a.logits, b.logits)


def test_llama3_rope_scaling_through_rope_freqs(tmp_path):
    """The converter stores Llama-3 RoPE scaling only as per-frequency divisors (rope_freqs.weight);
    the reader recovers a scaling with the same frequencies (Llama-3.1's own parameters, head_dim
    128: a smooth band of frequencies; a tiny head_dim 8: none in the band)."""
    for head_dim, theta, scaling in (
            (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
            (8, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64})):
        cfg = eagle3_config(head_dim=head_dim, rope_theta=theta, rope_scaling=scaling)
        factors = gguf_eagle3.rope_factors(cfg)
        assert factors.shape == (head_dim // 2,) and factors.max() == pytest.approx(8.0)
        got = gguf_eagle3.llama3_scaling(factors, head_dim, theta, "d.gguf")
        want = np.array(rope_inv_freq(head_dim, theta, scaling))
        assert np.allclose(np.array(rope_inv_freq(head_dim, theta, got)), want, rtol=1e-5)
    assert gguf_eagle3.llama3_scaling(np.ones(4, np.float32), 8, 10000.0, "d.gguf") is None
    with pytest.raises(MlxspecError, match=r"d.gguf: rope_freqs.weight is not a Llama-3 RoPE scaling"):
        gguf_eagle3.llama3_scaling(np.array([1.0, 3.0, 1.5, 8.0], np.float32), 8, 10000.0, "d.gguf")


def test_llama3_drafter_round_trip_drafts_the_same(tmp_path):
    target = tiny_target("llama3_1", seed=0)
    cfg = eagle3_config(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    ref = random_eagle3(cfg, seed=5)
    save_drafter(ref, cfg, tmp_path / "spec", "speculators-eagle3", target=target)
    save_drafter(ref, cfg, tmp_path / "d.gguf", "gguf-eagle3", target=target)
    assert "rope_freqs.weight" in read_gguf(tmp_path / "d.gguf").tensor_map()
    model, got, _ = load(tmp_path / "d.gguf", target)
    assert got.rope_scaling["rope_type"] == "llama3"
    spec_model, spec_cfg, _ = load(tmp_path / "spec", target)
    a, b = drafts(model, got, target), drafts(spec_model, spec_cfg, target)
    assert a.tokens == b.tokens and np.allclose(np.array(a.logits), np.array(b.logits), atol=1e-4)


# ----------------------------------------------------------------------------- errors

def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_tensor_is_named(llama, made, tmp_path):
    cfg, _, spec = made
    path = llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg, drop=("layers.0.hidden_norm.weight",))
    with pytest.raises(MlxspecError) as e:
        load(path, llama)
    assert "missing tensor(s): blk.0.attn_norm_2.weight" in one_line(e)


def test_a_forks_tensor_names_are_named(llama, made, tmp_path):
    """A fork's spelling of hidden_norm: unclaimed and missing, both named."""
    cfg, _, spec = made
    path = llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg,
                          rename={"blk.0.attn_norm_2.weight": "blk.0.hidden_norm.weight"})
    with pytest.raises(MlxspecError) as e:
        load(path, llama)
    msg = one_line(e)
    assert "not claimed by the EAGLE-3 drafter its metadata describes: blk.0.hidden_norm.weight" in msg
    assert "missing tensor(s): blk.0.attn_norm_2.weight" in msg


def test_taps_past_the_target(llama, made, tmp_path):
    """Layer-input ids 2,3,4 on a 4-layer target: id 4 is the output of its last layer."""
    cfg, _, spec = made
    path = llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg, meta={"eagle3.target_layers": [2, 3, 4]})
    with pytest.raises(MlxspecError) as e:
        load(path, llama)
    assert "tap 4 (llama.cpp convention) is the output of layer 3, but" in one_line(e)


@pytest.mark.parametrize("meta, tap_key, expect", [
    ({"eagle3.target_layers": None}, "eagle3.target_layers", r"GGUF metadata has no eagle3.target_layers \(or "
                                                             r"eagle3.extract_layers\)"),
    ({"eagle3.extract_layers": [1, 2, 4]}, "eagle3.target_layers",
     r"eagle3.target_layers = \[1, 2, 3\] but eagle3.extract_layers = \[1, 2, 4\]"),
    ({"eagle3.target_layers": [0, 1, 2]}, "eagle3.target_layers", r"tap id 0 is the input of layer 0"),
    ({"eagle3.target_hidden_size": None}, "eagle3.target_layers", r"GGUF metadata has no eagle3.target_hidden_size"),
    ({"eagle3.fc_norm": True}, "eagle3.target_layers", r"eagle3.fc_norm = true is not supported"),
])
def test_metadata_errors(llama, made, tmp_path, meta, tap_key, expect):
    cfg, _, spec = made
    path = llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg, tap_key=tap_key, meta=meta)
    with pytest.raises(MlxspecError, match=expect) as e:
        load(path, llama)
    one_line(e)


def test_d2t_must_be_integer_ids(llama, made, tmp_path):
    cfg, _, spec = made
    path = llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg, d2t_type=np.float32)
    with pytest.raises(MlxspecError, match=r"tensor d2t has type F32, expected I32 or I64") as e:
        load(path, llama)
    one_line(e)


def test_writer_refuses_what_llama_cpp_cannot_run(made, tmp_path):
    cfg = eagle3_config(num_hidden_layers=2)
    with pytest.raises(MlxspecError, match=r"llama.cpp's EAGLE-3 GGUF cannot hold this drafter: 2 layers") as e:
        save_drafter(random_eagle3(cfg), cfg, tmp_path / "d.gguf", "gguf-eagle3")
    one_line(e)


def test_inspect_shows_the_taps(made, tmp_path):
    from mlxspec.inspect import inspect_path

    cfg, ref, spec = made
    text = inspect_path(llama_cpp_gguf(tmp_path / "d.gguf", spec, cfg))
    assert "role: drafter (eagle3), format gguf-eagle3" in text
    assert "taps (target layer outputs): 0, 1, 2; in the file: 1, 2, 3 (llama.cpp ids)" in text

"""The block layout's arithmetic (`drafters.config.Layout`) and the device record
(`mlxspec.device`): one table each, and every user of them agrees."""

from __future__ import annotations

import pytest

from mlxspec import device, kernels
from mlxspec.drafters.config import Layout

# (anchor_first, block) -> (first predicting row, drafts per block, shortest block, name)
TABLE = {
    (True, 16): (0, 16, 1, "anchor-first"),
    (False, 16): (1, 15, 2, "bonus-anchor"),
    (True, 1): (0, 1, 1, "anchor-first"),
    (False, 2): (1, 1, 2, "bonus-anchor"),
    (False, 8): (1, 7, 2, "bonus-anchor"),
}


@pytest.mark.parametrize("key", list(TABLE))
def test_layout_table(key):
    lay = Layout(*key)
    assert (lay.first_row, lay.n_drafts, lay.min_block, lay.name) == TABLE[key]
    # row first_row + i predicts position p + 1 + i: the block's rows past the anchor, in order
    rows_predicting = [r + (1 if lay.anchor_first else 0) for r in range(lay.first_row, lay.block_size)]
    assert rows_predicting == [1 + i for i in range(lay.n_drafts)]
    assert lay.with_block(4) == Layout(key[0], 4)


def test_block_drafter_and_config_use_the_layout(smollm2):
    """BlockDrafter's max_drafts / first_row are its config's Layout (with a shortened block)."""
    import mlx.core as mx

    from mlxspec.drafters.config import DrafterConfig
    from mlxspec.drafters.model import DFlashModel
    from mlxspec.engine.drafting import BlockDrafter

    target, _ = smollm2
    info = target.info
    for anchor_first in (True, False):
        cfg = DrafterConfig(hidden_size=info.hidden_size, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, block_size=6,
                            target_layer_ids=[1, 10, 20], mask_token_id=16, vocab_size=info.vocab_size,
                            sample_from_anchor=anchor_first)
        assert cfg.layout == Layout(anchor_first, 6) and cfg.n_drafts == cfg.layout.n_drafts
        mx.random.seed(0)
        m = DFlashModel(cfg)
        for bs in (None, 4):
            d = BlockDrafter(m, target, bs)
            lay = cfg.layout.with_block(bs or 6)
            assert (d.layout, d.max_drafts, d.first_row) == (lay, lay.n_drafts, lay.first_row)
        forced = BlockDrafter(m, target, force_sample_from_anchor=not anchor_first)
        assert forced.layout == Layout(not anchor_first, 6)


def test_device_record_reads_the_environment(monkeypatch):
    monkeypatch.delenv(device.KERNELS_ENV, raising=False)
    monkeypatch.delenv(device.NATIVE_LOWBIT_ENV, raising=False)
    d = device.current()
    assert d is device.current()  # computed once for the same environment
    assert (d.reference_kernels, d.native_lowbit) == (False, None)
    assert d.dense == (d.gpu is None)
    monkeypatch.setenv(device.KERNELS_ENV, "reference")
    monkeypatch.setenv(device.NATIVE_LOWBIT_ENV, "off")
    d2 = device.current()
    assert (d2.gpu, d2.reference_kernels, d2.native_lowbit) == (d.gpu, True, False)
    assert kernels.backend() == "reference"
    monkeypatch.setenv(device.KERNELS_ENV, "fastest")
    with pytest.raises(ValueError) as e:
        device.current()
    assert str(e.value) == "MLXSPEC_KERNELS='fastest': expected 'auto' or 'reference'"


def test_cpu_device_is_dense_with_reference_kernels():
    """On this machine's CPU backend: dense float32 targets and the reference kernels."""
    import mlx.core as mx

    from mlxspec.targets.load import default_dense

    if mx.metal.is_available() or device.current().gpu:
        pytest.skip("a GPU backend")
    assert device.current().dense and default_dense()
    assert kernels.backend() == "reference"


def test_environment_is_read_only_in_device_py():
    """No other mlxspec module reads the device switches (MLXSPEC_KERNELS, _NATIVE_LOWBIT,
    _OPENBLAS, _NO_BLAS_REEXEC) from the environment, nor sets them."""
    from pathlib import Path

    pkg = Path(device.__file__).parent
    names = ("MLXSPEC_KERNELS", "MLXSPEC_NATIVE_LOWBIT")
    offenders = [str(f.relative_to(pkg)) for f in pkg.rglob("*.py")
                 if f.name != "device.py" and any(n in f.read_text() and "os.environ" in f.read_text() for n in names)]
    assert offenders == []

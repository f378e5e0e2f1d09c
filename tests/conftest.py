"""Shared fixtures: the default SmolLM2-135M-Instruct target, loaded once per session.

`smollm2_path` is `mlxspec.cache.default_model_path()` (downloaded on first use into the
mlxspec cache). Offline and not cached: the tests that need it skip with the reason.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
    from mlxspec.loading.target import load_target

    return load_target(str(smollm2_path))

"""The suite runs on a temporary mlxspec cache of its own (tests/conftest.py): neither this test
process nor the processes the tests start read or write the user's cache, and what one run
cached cannot make the next one pass (issue 39: a data store left in ~/.cache/mlxspec by a first
run hid a crash in its preparation from every later run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import conftest


def test_the_session_runs_on_its_own_temporary_cache():
    from mlxspec.cache import cache_dir

    assert cache_dir() == conftest.TEST_CACHE and cache_dir().is_dir()
    assert conftest.TEST_CACHE.name.startswith("mlxspec-test-cache-")
    assert conftest.TEST_CACHE.resolve() != conftest.USER_CACHE.resolve()
    assert conftest.TEST_CACHE.resolve() != (Path.home() / ".cache" / "mlxspec").resolve()


def test_processes_the_tests_start_inherit_it():
    r = subprocess.run([sys.executable, "-c", "from mlxspec.cache import cache_dir; print(cache_dir())"],
                       capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == str(conftest.TEST_CACHE), r.stderr


def test_the_shared_default_model_is_only_linked(smollm2_path):
    """The packaged model is the one thing shared with other caches, read-only: a link to a
    verified copy, or the session's own download."""
    assert smollm2_path.parent == conftest.TEST_CACHE / "models"
    if smollm2_path.is_symlink():
        src = smollm2_path.resolve()
        assert src.parent in ((conftest.USER_CACHE / "models").resolve(), (conftest.CLONE_CACHE / "models").resolve())

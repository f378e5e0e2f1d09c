"""Test helpers: llama.cpp's golden tokenizer data and the small test model.

llama.cpp ships vocab-only GGUF files with expected tokenizations (``models/ggml-vocab-*.gguf`` with
``.gguf.inp`` / ``.gguf.out``); the llama-cpp-python source archive on PyPI vendors them. They are
fetched once into this clone's ``.cache/llama-cpp-python-0.3.36/models`` (gitignored; only those
files are extracted and the 148 MB archive is deleted after), never into the user's mlxspec
cache. Set ``MLXSPEC_NO_DOWNLOAD=1`` to never download; tests then skip when the files are absent.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

LLAMA_CPP_PYTHON = ("llama-cpp-python", "0.3.36")
GOLDEN_SEPARATOR = "\n__ggml_vocab_test__\n"

# Vocab files in llama-cpp-python 0.3.36 that come with golden tokenizations.
GOLDEN_VOCABS = (
    "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
    "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)
# Golden vocab files whose tokenizer family is refused on purpose, with a word the error names.
REFUSED_VOCABS = {"bert-bge": "bert"}



def golden_root() -> Path:
    return Path(__file__).resolve().parent.parent / ".cache" / f"{LLAMA_CPP_PYTHON[0]}-{LLAMA_CPP_PYTHON[1]}"


@lru_cache(maxsize=1)
def golden_dir() -> tuple[Path | None, str]:
    """(directory with the ggml-vocab-* files, or None; reason when None). Downloads once."""
    models = golden_root() / "models"
    if (models / "ggml-vocab-gpt-2.gguf.inp").is_file():
        return models, ""
    if os.environ.get("MLXSPEC_NO_DOWNLOAD"):
        return None, f"llama.cpp golden vocab files absent from {models} and MLXSPEC_NO_DOWNLOAD is set"
    from mlxspec.cache import extract_members, fetch_pypi_sdist
    from mlxspec.errors import MlxspecError

    try:
        archive = fetch_pypi_sdist(*LLAMA_CPP_PYTHON, golden_root(), timeout=30)
        extract_members(archive, models, lambda n: "/vendor/llama.cpp/models/ggml-vocab-" in n)
        archive.unlink()  # the extracted files are what is kept
    except (MlxspecError, OSError) as e:
        return None, f"llama.cpp golden vocab files unavailable (offline?): {e}"
    if not (models / "ggml-vocab-gpt-2.gguf.inp").is_file():
        return None, f"{LLAMA_CPP_PYTHON[0]}=={LLAMA_CPP_PYTHON[1]} has no models/ggml-vocab-* files"
    return models, ""


def vocab_path(name: str) -> tuple[Path | None, str]:
    d, why = golden_dir()
    if d is None:
        return None, why
    p = d / f"ggml-vocab-{name}.gguf"
    if not p.is_file():
        return None, f"{p.name} not in the golden data"
    return p, ""


def read_golden(path: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs, parsed like llama.cpp's tests/test-tokenizer-0.cpp."""
    raw = Path(str(path) + ".inp").read_bytes().decode("utf-8")
    inputs = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(GOLDEN_SEPARATOR, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(GOLDEN_SEPARATOR)
    lines = Path(str(path) + ".out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(inputs) == len(lines), f"{path.name}: {len(inputs)} inputs but {len(lines)} outputs"
    return [(s, [int(x) for x in o.split()]) for s, o in zip(inputs, lines)]


def test_gguf_path() -> tuple[Path | None, str]:
    """The SmolLM2 test model: MLXSPEC_TEST_GGUF if set, else the project's default model,
    from the session's mlxspec cache (tests/conftest.py: linked from a verified copy, or
    fetched there on first use, as `mlxspec generate` does)."""
    if os.environ.get("MLXSPEC_TEST_GGUF"):
        p = Path(os.environ["MLXSPEC_TEST_GGUF"])
        return (p, "") if p.is_file() else (None, f"MLXSPEC_TEST_GGUF={p} is not a file")
    from mlxspec.cache import default_model_path
    from mlxspec.errors import MlxspecError

    try:
        return default_model_path(), ""
    except MlxspecError as e:
        return None, f"SmolLM2-135M-Instruct GGUF not cached and cannot be downloaded: {e}"


test_gguf_path.__test__ = False  # not a test

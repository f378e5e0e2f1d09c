"""MLX's compiled CPU kernels built for this CPU (mlxspec.cpu_jit): on by default here, the same
bits as MLX's generic build in a target's logits, and a check that refuses a build that is not."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxspec import cpu_jit

pytestmark = pytest.mark.skipif(not (sys.platform.startswith("linux") and os.uname().machine == "x86_64"),
                                reason="x86-64 Linux only")

# a tiny llama (its MLP is mlx-lm's compiled swiglu) and a 9-row forward over a prompt's cache:
# the sha256 of the logits' bytes, and the module's status line
_FORWARD = """
import hashlib, json, sys
sys.path.insert(0, {tests!r})
import mlxspec
from mlxspec import cpu_jit
import mlx.core as mx, numpy as np
from tiny_targets import tiny_target
t = tiny_target("llama", seed=3, vocab=64)
cache = t.make_cache()
lg, _ = t(mx.array([[(7 * i) % 64 for i in range(40)]]), cache, logits="all")
lg2, _ = t(mx.array([[(5 * i + 1) % 64 for i in range(9)]]), cache, logits="all")
mx.eval(lg, lg2)
h = hashlib.sha256(np.array(lg).tobytes() + np.array(lg2).tobytes()).hexdigest()
print(json.dumps({{"sha": h, "status": cpu_jit.status(), "active": cpu_jit.active()}}))
"""


def _run(code: str, **env) -> dict:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_it_is_on_here_and_checked():
    from tiny_targets import tiny_target

    tiny_target("llama")  # the first target checks the bits
    assert cpu_jit.active(), cpu_jit.status()
    assert cpu_jit.check()
    d = cpu_jit._STATE["dir"]
    assert (d / "verdict").read_text().strip() == "ok"
    assert os.environ["TMPDIR"] == str(d / "tmp") and os.environ["PATH"].startswith(str(d / "bin"))
    assert not tempfile.gettempdir().startswith(str(d)), "Python's temporary folder moved too"
    # a compiled function of this process was built by the wrapper into the kernel folder
    f = mx.compile(lambda a: mx.sigmoid(a) * 2.71875 - a)
    mx.eval(f(mx.ones(8)))
    assert any(p.name.endswith(".so") for p in (d / "tmp").rglob("*Sigmoid*")), list((d / "tmp").rglob("*"))


def test_logits_are_the_generic_builds_bit_for_bit():
    tests = str(Path(__file__).parent)
    with tempfile.TemporaryDirectory() as generic_tmp:
        # MLX's own build: the wrapper off PATH too, the kernels in a folder of their own
        off = _run(_FORWARD.format(tests=tests), MLXSPEC_NATIVE_JIT="0", TMPDIR=generic_tmp,
                   PATH=cpu_jit._strip_ours(os.environ["PATH"]))
        # generic x86-64: exp's fused multiply-adds are calls into libm's fmaf; built here, instructions
        generic = [p for p in Path(generic_tmp).rglob("*Sigmoid*.so")]
        assert generic and all(b"fmaf" in p.read_bytes() for p in generic), generic
        on = _run(_FORWARD.format(tests=tests))
    assert not off["active"] and off["status"].endswith(f"off ({cpu_jit.ENV}=0)"), off
    assert on["active"] and "built for this CPU" in on["status"], on
    native = [p for p in (cpu_jit._STATE["dir"] / "tmp").rglob("*Sigmoid*.so")]
    assert native and not any(b"fmaf" in p.read_bytes() for p in native), native
    assert on["sha"] == off["sha"]


def test_the_check_refuses_a_build_that_fuses_multiply_adds(tmp_path):
    """-ffp-contract=fast fuses some of exp's multiplies and adds: other bits, and the check
    must say so, turn itself off and keep the verdict for the next process."""
    code = f"""
import json
from pathlib import Path
import mlxspec
from mlxspec import cpu_jit
cpu_jit.FLAGS = ("-march=native", "-ffp-contract=fast")
assert cpu_jit.enable(force=True, root=Path({str(tmp_path)!r}))
import mlx.core
ok = cpu_jit.check()
again = cpu_jit.enable(force=True, root=Path({str(tmp_path)!r}))
print(json.dumps({{"ok": ok, "active": cpu_jit.active(), "status": cpu_jit.status(), "again": again}}))
"""
    out = _run(code, MLXSPEC_NATIVE_JIT="0")
    assert out["ok"] is False and out["active"] is False and out["again"] is False, out
    assert "exp" in out["status"] and "differ from MLX's ops" in out["status"], out["status"]
    verdicts = list(tmp_path.rglob("verdict"))
    assert len(verdicts) == 1 and "exp" in verdicts[0].read_text()


def test_a_child_process_does_not_wrap_the_wrapper():
    """A child inherits PATH with the wrapper first; its own enable must find the real g++."""
    out = _run("import json, mlxspec, os; from mlxspec import cpu_jit; "
               "import tempfile; print(json.dumps({'dir': str(cpu_jit._STATE.get('dir')), 'path': os.environ['PATH'], "
               "'tempdir': tempfile.gettempdir()}))")
    d = cpu_jit._STATE["dir"]
    assert out["dir"] == str(d)
    assert not out["tempdir"].startswith(str(d)), out  # the child's tempfile is the folder outside ours
    entries = [p for p in out["path"].split(os.pathsep) if p.endswith(os.sep + "bin") and cpu_jit.DIR_NAME in p]
    assert entries == [str(d / "bin")], out["path"]  # one wrapper, its own
    assert "exec '/" in (d / "bin" / "g++").read_text() and cpu_jit.DIR_NAME not in (d / "bin" / "g++").read_text()

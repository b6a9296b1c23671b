"""bench/gpu.sh --dry-run: every step of the GPU run that the CPU can run, at tiny sizes, so
that the script cannot rot between GPU runs (issue 31). About 55 s on this 2-core machine."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# bench/ is not put on sys.path: its kernels.py would hide the kernels package.
_spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
gpu = sys.modules["bench_gpu"] = importlib.util.module_from_spec(_spec)  # for its dataclass
_spec.loader.exec_module(gpu)
MANIFEST, read_manifest = gpu.MANIFEST, gpu.read_manifest

# The dry run takes 50-60 s here (2 cores), three steps at a time: 55 s alone, 61 s at a load
# average of 7 from other work. The rest is slack for a machine that others share.
LIMIT = 120


@pytest.mark.slow
def test_the_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([str(ROOT / "bench" / "gpu.sh"), "--dry-run", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=LIMIT,
                         env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    names = [r["step"] for r in sorted(results, key=lambda r: r["n"])]  # as they ended
    assert names == ["wheels", "api", "kernels", "parity", "daemon", "bench-kernels",
                     "bench-engine", "bench-kernel"]
    assert all(r["status"] in ("pass", "skip") for r in results), results
    assert (out / "summary.txt").read_text().strip().endswith("all passed")
    assert run.stdout.rstrip().endswith("all passed")  # the table comes last


def test_only_refuses_a_step_there_is_not(tmp_path):
    """A misspelt --only ran nothing and said "all passed"."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run",
                          "--only", "api,kernel", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--only: no step kernel" in run.stderr, run.stderr
    assert not (tmp_path / "summary.txt").exists()


def test_a_bad_manifest_is_caught(tmp_path):
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"wheel")
    sha = "0" * 64
    (tmp_path / MANIFEST).write_text(f"a\t1.0\t{sha}\ta-1.0-py3-none-any.whl\n")
    with pytest.raises(ValueError, match="sha256 differs"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST).write_text("a\t1.0\n")
    with pytest.raises(ValueError, match="want name, version, sha256, file"):
        read_manifest(tmp_path)
    good = hashlib.sha256(b"wheel").hexdigest()
    (tmp_path / MANIFEST).write_text(f"# comment\na\t1.0\t{good}\ta-1.0-py3-none-any.whl\n")
    assert read_manifest(tmp_path)[0]["version"] == "1.0"


@pytest.mark.parametrize("dry", [False, True])
def test_every_test_a_step_names_is_there(dry, tmp_path):
    """The GPU run's steps name test files and tests the dry run does not all run (a file
    renamed once left the GPU's daemon step pointing at nothing)."""
    named = [a for step in gpu.steps(dry, tmp_path) if step.argv
             for a in step.argv if a.startswith("tests/")]
    assert named
    for arg in named:
        path, _, test = arg.partition("::")
        assert (ROOT / path).is_file(), arg
        if test:
            assert f"def {test.partition('[')[0]}(" in (ROOT / path).read_text(), arg

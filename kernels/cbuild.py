"""Builds the C kernels (``*.c`` beside this file) with the system's C compiler on first use,
caches each library by a hash of what went into it, and loads it with ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp then serves the libraries' OpenMP too)

# -march=native: a library is built on the machine that runs it, and the cache key holds
# the CPU's feature flags, so a cache shared with another machine never runs its build.
# No errno and no trapping: libm calls and compares that GCC may then vectorize.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
         "-shared", "-fPIC")
CACHE_ENV = "SYMPHONY_CACHE"


def cache_dir() -> Path:
    """SYMPHONY_CACHE, else $XDG_CACHE_HOME/symphony, else ~/.cache/symphony."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "symphony"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The library built from ``kernels/<name>.c``; RuntimeError naming the compiler and its
    output if it won't build."""
    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC", "cc")
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]
    parts = [source.read_bytes(), *headers, " ".join(FLAGS).encode(), compiler.encode(),
             _cpu_flags().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = cache_dir() / f"{name}-{key}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RuntimeError(f"building {source.name}: cache directory: {e}") from e
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            done = subprocess.run(
                [compiler, *FLAGS, "-o", str(tmp), str(source), "-lm"],
                capture_output=True, text=True,
            )
        except OSError as e:
            raise RuntimeError(f"building {source.name}: cannot run {compiler!r}: {e}") from e
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"building {source.name} with {compiler} failed:\n{done.stderr}")
        os.replace(tmp, path)  # atomic: concurrent builders each install a whole library
    return ctypes.CDLL(str(path))


def check(name: str, t: torch.Tensor, dtype: torch.dtype = torch.float32,
          contiguous: bool = False) -> None:
    """The C kernels take CPU tensors whose last dimension (or whole, if `contiguous`) is
    contiguous. Called on every kernel call, so written to be cheap."""
    if (t.dtype != dtype or not t.is_cpu
            or not (t.is_contiguous() if contiguous else t.stride(-1) == 1)):
        layout = "contiguous" if contiguous else "with a contiguous last dimension"
        raise ValueError(f"{name} must be a CPU {dtype} tensor, {layout}")

"""`make gpu-wheels`: the wheels the GPU image lacks, for Python 3.12 manylinux x86_64, into
bench/gpu-wheels/ (git-ignored; the device machine gets it as a carried path), with
MANIFEST.tsv (name, version, sha256, file: tab-separated).

Which: what the project imports (pyproject.toml's dependencies and dev extras), and what
those need, at the versions this venv has (the ones the suite passes with), less what the
image has (IMAGE, and whatever those need: the image installed it with them) and what
cannot come (bench/gpu.py's SKIPPED: pyfuse3 links libfuse3). bench/gpu.py installs each
only where the image lacks it, --no-deps. Under 64 MiB in all, or this fails.

    python bench/gpu_wheels.py [--dest DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from gpu import MANIFEST, SKIPPED, WHEELS  # noqa: E402  (bench/, this script's folder)

# The GPU image's own (issue 31), and ours that the GPU run needs not: linters, proto tools.
IMAGE = {"torch", "triton", "grpcio", "protobuf", "uvloop", "safetensors", "tokenizers",
         "transformers", "numpy"}
NOT_NEEDED = {"ruff", "grpcio-tools"}
TARGET = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "extra": ""}
LIMIT = 64 << 20
# glibc 2.31 (Ubuntu 20.04) and later take every one of these; llguidance's wheel is 2_31.
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement(spec: str) -> str | None:
    """A requirement's name where its marker holds on the target (no extras asked for)."""
    from packaging.requirements import Requirement

    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate(TARGET):
        return None
    return norm(req.name)


def closure() -> dict[str, str]:
    """name -> version in this venv, of what the GPU run needs beyond the image."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    stop = {norm(n) for n in (*IMAGE, *NOT_NEEDED, *SKIPPED)}
    found: dict[str, str] = {}
    while todo:
        name = requirement(todo.pop())
        if name is None or name in stop or name in found:
            continue
        found[name] = metadata.version(name)
        todo += metadata.requires(name) or []
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=WHEELS)
    args = ap.parse_args()
    want = closure()
    dest = args.dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    rows = []
    for name, version in sorted(want.items()):
        before = set(dest.iterdir())
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
             *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
             f"{name}=={version}"], check=True)
        (wheel,) = set(dest.iterdir()) - before
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        rows.append(f"{name}\t{version}\t{sha}\t{wheel.name}")
        print(f"{name} {version}: {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    header = (f"# bench/gpu_wheels.py: for Python 3.12 manylinux x86_64; skipped by name: "
              f"{', '.join(SKIPPED)}; the image has {', '.join(sorted(IMAGE))}\n")
    (dest / MANIFEST).write_text(header + "\n".join(rows) + "\n")
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(rows)} wheels, {size / 2**20:.1f} MiB in {dest}")
    if size > LIMIT:
        print("over the 64 MiB a device run carries", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The committed gRPC stubs are what `make proto` makes from syscalls/symphony.proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUBS = ("symphony_pb2.py", "symphony_pb2_grpc.py")


def test_stubs_are_fresh(tmp_path):
    (tmp_path / "syscalls").mkdir()
    shutil.copy(ROOT / "syscalls" / "symphony.proto", tmp_path / "syscalls")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
         "--grpc_python_out=.", "syscalls/symphony.proto"],
        cwd=tmp_path, check=True,
    )
    for name in STUBS:
        fresh = (tmp_path / "syscalls" / name).read_text()
        committed = (ROOT / "syscalls" / name).read_text()
        assert fresh == committed, f"syscalls/{name} is stale: run `make proto`"

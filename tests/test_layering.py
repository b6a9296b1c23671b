"""The folders' rule (docs/syscalls.md): a LIP, and the library it uses, reach the kernel only
through syscalls, so syscalls/ imports nothing of the project but itself, and lips/ nothing but
syscalls and its own modules (a program of several files, such as the server's lips/serving/).
The file system sits below the kernel and its engine: kvfs/ imports nothing of symphony/, only
itself and syscalls (the mount is a client of the kernel's syscalls)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"symphony", "kvfs", "kernels", "lips", "models", "syscalls"}
ALLOWED = {"lips": {"syscalls", "lips"}, "syscalls": {"syscalls"}, "kvfs": {"kvfs", "syscalls"}}


def project_imports(path: Path) -> set[str]:
    """Top-level project packages a file imports, anywhere in it (lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & PROJECT
    return found


def test_lips_the_library_and_kvfs_import_only_layers_below():
    files = sorted([*(ROOT / "lips").rglob("*.py"), *(ROOT / "syscalls").glob("*.py"),
                    *(ROOT / "kvfs").glob("*.py")])
    assert len(files) > 10 and any(f.parent.name == "kvfs" for f in files)
    rel = {f: f.relative_to(ROOT) for f in files}
    bad = {str(r): sorted(project_imports(f) - ALLOWED[r.parts[0]]) for f, r in rel.items()}
    assert {f: mods for f, mods in bad.items() if mods} == {}


def test_the_check_sees_a_forbidden_import(tmp_path):
    lip = tmp_path / "lip.py"
    lip.write_text("import os\n\ndef main():\n    from kvfs.fs import FileSystem\n")
    assert project_imports(lip) == {"kvfs"}

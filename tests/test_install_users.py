"""An install is every local user's: a real unprivileged user (made with useradd, not a bare
uid set by a Python that root started) runs a LIP with the installed `symphony` against a
kernel root started, as README's "Quick start" says a multi-user install allows.

The venv's interpreter is what makes or breaks this: one linked into a pyenv under root's
home (mode 0700) cannot even be started by others, and a copied binary still loads its
standard library from its base prefix, so the user must get root's Python from it, standard
library included, not merely a Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from daemon import ROOT


def _out_of_reach(path: Path) -> Path | None:
    """The first directory on the way to path that other users cannot enter, if any."""
    for d in (path, *path.parents):
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


# A checkout under a directory others cannot enter (root's home) is root's alone, whatever
# the interpreter: make install warns, and there is nothing for another user to run.
CLOSED = _out_of_reach(ROOT)
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to add a user"),
    pytest.mark.skipif(CLOSED is not None, reason=f"other users cannot enter {CLOSED}"),
]

VENV_BIN = Path(sys.executable).parent
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def user():
    """A fresh system user with no home and no groups but its own, removed afterwards."""
    name = f"symtest{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [
            "useradd",
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            name,
        ],
        check=True,
        capture_output=True,
    )
    yield name
    subprocess.run(["userdel", name], check=True, capture_output=True)


def as_login(user: str, *cmd: str, socket: Path | None = None) -> subprocess.CompletedProcess:
    """cmd run by user with a login's plain environment: nothing of root's but the socket.
    A program the user cannot execute ends as in a shell: setpriv exits 126, the error on
    stderr. Through setpriv, not subprocess's user= (daemon.as_user says why)."""
    env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    if socket:
        env["SYMPHONY_SOCKET"] = str(socket)
    return subprocess.run(
        ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_user_gets_roots_python_from_the_venv_standard_library_included(user):
    # A venv of copied binaries starts for others even when its base prefix is out of their
    # reach: the loader and the prefix search fall back to the system's Python, another one.
    python = VENV_BIN / "python"
    which = "import os, sys; print(sys.version, sys.base_prefix, os.__file__)"
    roots = subprocess.run([python, "-I", "-c", which], capture_output=True, text=True)
    theirs = as_login(user, str(python), "-I", "-c", which)
    assert (theirs.returncode, theirs.stdout) == (0, roots.stdout), (
        f"{user} does not get root's {python} (it is {python.resolve()}, root's base prefix "
        f"{sys.base_prefix}): make install with a Python every user can run (README, "
        f"Quick start)\n{theirs.stderr}"
    )


def test_an_unprivileged_user_runs_a_lip_against_roots_kernel(user, daemon):
    argv = ["--prompt", PROMPT, "--max-new-tokens", "6", "--json"]
    mine = subprocess.run(
        [str(VENV_BIN / "symphony"), "run", "lips/complete.py", *argv],
        env=daemon.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert mine.returncode == 0, mine.stderr
    theirs = as_login(
        user,
        str(VENV_BIN / "symphony"),
        "run",
        str(ROOT / "lips" / "complete.py"),
        *argv,
        socket=daemon.socket,
    )
    assert theirs.returncode == 0, theirs.stderr
    answer = json.loads(theirs.stdout)
    assert len(answer["output_ids"]) == 6 and answer == json.loads(mine.stdout)

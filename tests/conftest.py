"""Fixtures shared by the suite: the test model and a real kernel daemon on it.

A module sets the daemon's flags with a module-level `DAEMON_FLAGS` tuple (default below);
each module gets its own daemon, stopped cleanly at the module's end. A test that uses
either fixture runs a real daemon, so it is marked `slow` here.
"""

import importlib
import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's model, wherever a test (or a process it starts) gives none, is the small one the
# project ships, not the default users get (SmolLM2-135M-Instruct where it is installed, 25x
# larger): tests/test_default_model.py and tests/test_gguf.py check that one themselves.
os.environ["SYMPHONY_MODEL"] = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "models", "tiny")

from daemon import make_model, mounted, start_daemon, start_server  # noqa: E402  (after TRITON_INTERPRET)

DEFAULT_DAEMON_FLAGS = ("--kv-pages", "512")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if {"model", "daemon"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    """A random-weight Llama with a tokenizer (tests/daemon.py's make_model)."""
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def daemon(request, model):
    d = start_daemon(model, None, *getattr(request.module, "DAEMON_FLAGS", DEFAULT_DAEMON_FLAGS))
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def mnt(daemon):
    """The module's daemon mounted (FUSE), unmounted at the module's end."""
    with mounted(daemon) as (target, _):
        yield target


@pytest.fixture()
def k(daemon):
    """A session of root's on the module's daemon."""
    with daemon.connect() as k:
        yield k


@pytest.fixture(scope="module")
def server(request, daemon):
    """`symphony serve` on the module's daemon (flags from a module's `SERVE_FLAGS`), with
    OpenAI clients (`.client`, `.aclient`); stopped with SIGTERM at the module's end, which
    must exit 0."""
    s = start_server(daemon, *getattr(request.module, "SERVE_FLAGS", ()))
    yield s
    assert s.stop() == 0, s.log_text()


@pytest.fixture()
def lip_main(capsys):
    """lips.PROG's main(argv) run in this process: its status, stdout and stderr."""
    def run(prog: str, *argv: str) -> tuple[int, str, str]:
        try:
            code = importlib.import_module(f"lips.{prog}").main(list(argv))
        except SystemExit as e:  # argparse's exit
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run

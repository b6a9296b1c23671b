"""--save PATH, in the LIPs that keep their conversation's KV file: a path that a link
cannot take (it exists, or its directory does not) is refused before anything is generated,
not after the whole answer (which was then lost)."""

from __future__ import annotations

import importlib

import pytest

ARGV = {  # each program's other flags
    "chat": ["--message", "hi", "--max-new-tokens", "2"],
    "agent": ["--question", "hi", "--max-turns", "1", "--max-new-tokens", "2"],
    "async_lm": ["--prompt", "hi", "--max-new-tokens", "2"],
}


@pytest.fixture()
def lip(daemon, capsys, monkeypatch):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))

    def run(prog: str, *argv: str) -> tuple[int, str, str]:
        code = importlib.import_module(f"lips.{prog}").main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.mark.parametrize("prog", ARGV)
def test_a_save_path_that_cannot_be_linked_is_refused_up_front(lip, k, prog):
    name = f"save-{prog}.kv"
    assert lip(prog, *ARGV[prog], "--save", name)[0] == 0
    assert k.stat(f"{k.home}/{name}").tokens > 0
    code, out, err = lip(prog, *ARGV[prog], "--save", name)
    assert (code, out) == (1, "")
    assert err == f"{prog}: '{k.home}/{name}': File exists\n"
    code, out, err = lip(prog, *ARGV[prog], "--save", f"no-such-dir/{name}")
    assert (code, out) == (1, "")
    assert err.startswith(f"{prog}: ") and "no-such-dir" in err
    k.unlink(f"{k.home}/{name}")

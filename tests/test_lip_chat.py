"""lips/chat.py on a real daemon where a conversation ends early: a turn that would pass the
model's context, a stdin line that is not UTF-8. Either stops before that turn with one line
naming why, and --save keeps the turns answered."""

from __future__ import annotations

import importlib
import io
import sys

import pytest

NEW = ["--max-new-tokens", "8"]


@pytest.fixture()
def lip(daemon, capsys, monkeypatch):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))

    def run(*argv: str) -> tuple[int, str, str]:
        code = importlib.import_module("lips.chat").main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_a_turn_past_the_context_stops_the_conversation_and_save_keeps_the_rest(lip, k):
    """The third turn would pass the context: chat says so and what to do, status 1, with
    the two turns answered saved (it failed EOVERFLOW in the pred, the conversation lost)."""
    context = k.model_info().context_length
    line = "the sea and the ships and the sailors who went out. "
    turn = line * (context // 3 // len(k.tokenize(line)))
    size = len(k.tokenize(turn))
    code, out, err = lip("--message", turn, "--message", turn, "--message", turn, *NEW,
                         "--save", "full.kv")
    assert code == 1 and out, err
    head, _, rest = err.partition(" is ")
    assert head == "chat: stopped after 2 turns: the conversation with the next turn", err
    assert rest.endswith(f" tokens, and with --max-new-tokens 8 it would pass the model's "
                         f"context of {context} positions; start a new conversation\n"), err
    assert int(rest.split()[0]) + 8 > context
    saved = k.open(f"{k.home}/full.kv")
    try:
        tokens = saved.read()[0]
    finally:
        saved.close()
    first = k.tokenize(messages=[{"role": "user", "content": turn}], add_generation_prompt=True)
    assert tokens[: len(first)] == first
    assert 2 * size < len(tokens) < 3 * size  # two turns and their replies, not the third
    k.unlink(f"{k.home}/full.kv")
    assert lip("--message", turn, *NEW)[0] == 0  # a new conversation takes it
    code, out, err = lip("--message", turn * 4, *NEW)
    assert (code, out) == (1, "") and err.startswith("chat: stopped after 0 turns: "), err
    code, out, err = lip("--message", turn, "--message", turn * 3, *NEW)
    assert code == 1 and out and err.startswith("chat: stopped after 1 turn: "), err


def test_a_stdin_line_that_is_not_utf8_stops_the_conversation_naming_its_offset(
    lip, k, monkeypatch
):
    """Turns from stdin lines: the line that is not UTF-8 is a usage error naming stdin and
    the byte's offset, whatever the locale, and the turns before it are saved (it was
    "chat: 'utf-8' codec can't decode byte 0xd0 in position 7", its line's offset, under a
    UTF-8 locale; the kernel's EINVAL naming neither under C)."""
    for errors in ("strict", "surrogateescape"):
        stdin = io.TextIOWrapper(io.BytesIO(b"hi\nsecond \xd0(\nthird\n"), errors=errors)
        monkeypatch.setattr(sys, "stdin", stdin)
        code, out, err = lip(*NEW, "--save", "lines.kv")
        assert (code, err) == (
            2, "chat: error: standard input: not UTF-8 text (byte 0xd0 at offset 10)\n"
        ), out
        saved = k.open(f"{k.home}/lines.kv")
        try:
            tokens = saved.read()[0]
        finally:
            saved.close()
        hi = k.tokenize(messages=[{"role": "user", "content": "hi"}],
                        add_generation_prompt=True)
        assert tokens[: len(hi)] == hi and len(tokens) <= len(hi) + 8
        k.unlink(f"{k.home}/lines.kv")

"""What every LIP does with its flags the same way, before the kernel is asked: each is
refused with status 2 and a message naming the flag (no kernel runs here: the socket named
does not exist, so a flag that got past the checks would be status 1)."""

from __future__ import annotations

import io
import sys

import pytest

from syscalls.session import FD_MAX

BYTES = b'{"x": "' + b"y" * 17 + b'\xd0(' + b'"}\n'  # 0xd0 at offset 24 starts no UTF-8 char


@pytest.fixture(autouse=True)
def no_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(tmp_path / "none.sock"))


@pytest.mark.parametrize(("prog", "flag", "argv"), [
    ("complete", "argument --prompt-file:", ["--prompt-file", "{}"]),
    ("constrained", "argument --schema:", ["--prompt-ids", "1", "--schema", "{}"]),
    ("async_lm", "argument --script:", ["--prompt-ids", "1", "--script", "{}"]),
    ("sink", "argument --stream:", ["--stream", "{}"]),
    ("prompt_cache", "argument --document:", ["--document", "{}", "--question", "q",
                                             "--cache", "d.kv"]),
    ("prompt_cache", "argument --schema:", ["--schema", "{}", "--prompt", "<p/>"]),
    ("chat", "argument --message-file:", ["--message-file", "{}"]),
    ("agent", "--script", ["--question", "q", "--script", "{}"]),
])
def test_a_file_that_is_not_utf8_is_a_usage_error_naming_it(lip_main, tmp_path, prog, flag,
                                                            argv):
    path = tmp_path / "bin.json"
    path.write_bytes(BYTES)
    code, out, err = lip_main(prog, *[str(path) if a == "{}" else a for a in argv])
    assert (code, out) == (2, "")
    assert f"{prog}: error: {flag} {path}: not UTF-8 text (byte 0xd0 at offset 24)" in err


@pytest.mark.parametrize(("prog", "flag", "argv"), [
    ("complete", "--prompt", []),
    ("sink", "--prompt", []),
    ("chat", "--message", []),
    ("chat", "--system", ["--message", "hi"]),
    ("prompt_cache", "--question", ["--document", "{}", "--cache", "d.kv"]),
    ("agent", "--question", []),
])
@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # the locale's choice
def test_stdin_that_is_not_utf8_is_a_usage_error_naming_it(lip_main, monkeypatch, tmp_path,
                                                           prog, flag, argv, errors):
    """FLAG - reads the text from standard input as UTF-8, whatever the locale: a byte that
    is not is the flag's usage error naming stdin and the byte's offset (it was argparse's
    "invalid text_arg value: '-'" under a UTF-8 locale, and under C or C.UTF-8 the kernel's
    EINVAL from tokenize, status 1, naming neither)."""
    path = tmp_path / "doc.txt"
    path.write_text("a document")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(BYTES), errors=errors))
    code, out, err = lip_main(prog, flag, "-", *[str(path) if a == "{}" else a for a in argv])
    assert (code, out) == (2, "")
    assert err.endswith(f"{prog}: error: argument {flag}: standard input: not UTF-8 text "
                        "(byte 0xd0 at offset 24)\n"), err


def test_stdin_text_is_read_as_text_mode_reads_it(monkeypatch):
    from syscalls.flags import text_arg

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("é\r\nx\ry\n".encode())))
    assert text_arg("-") == "é\nx\ny\n"


def test_best_of_n_takes_no_more_branches_than_a_process_may_hold(lip_main):
    """Each branch is a KV file the process holds open (FD_MAX, with the prompt's): --n
    99999999999 built that many coroutines before the first fork, growing by 100 MB a
    second, deaf to Ctrl-C (an outside tester's finding)."""
    code, out, err = lip_main("best_of_n", "--prompt-ids", "1", "--n", "99999999999")
    assert (code, out) == (2, "")
    assert err.endswith(f"best_of_n: error: argument --n: must be in [1, {FD_MAX - 1}], got "
                        "99999999999\n")

"""What every LIP does with its flags the same way, before the kernel is asked: each is
refused with status 2 and a message naming the flag (no kernel runs here: the socket named
does not exist, so a flag that got past the checks would be status 1)."""

from __future__ import annotations

import pytest

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

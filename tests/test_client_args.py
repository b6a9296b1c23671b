"""What a client sends for arguments a field cannot hold as given: a command line with
bytes that are not UTF-8, a KV path with them, chat messages that are not mappings; and a
command whose stdout's reader goes away (`symphony ps | head -1`)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys

import pytest
from daemon import ROOT, SYMPHONY, run_reader_gone

from syscalls import convert
from syscalls.aio import AsyncKernel

NOT_UTF8 = os.fsdecode(b"caf\xe9")  # as sys.argv and os.listdir hold it: a surrogate escape


def test_attach_shows_a_byte_of_argv_that_is_not_utf8_as_an_escape():
    """The argv went unchanged, and protobuf refused it: every LIP given such an argument
    (a file name) failed at attach with "an argument does not fit its field"."""
    call = convert.attach(None, [f"/x/{NOT_UTF8}.py", NOT_UTF8, "naïve", "\ud800"])
    assert list(call.request.argv) == ["/x/caf\\xe9.py", "caf\\xe9", "naïve", "\\ud800"]
    assert call.request.name == "caf\\xe9.py"
    assert convert.attach(NOT_UTF8, []).request.name == "caf\\xe9"


@pytest.mark.parametrize("build", [
    lambda p: convert.open(p), lambda p: convert.stat(p), lambda p: convert.mkdir(p),
    lambda p: convert.rename("/tmp/a", p), lambda p: convert.import_chunks(p, 0o600, b""),
])
def test_a_kv_path_that_is_not_utf8_is_einval_naming_it(build):
    """It was "an argument does not fit its field ('utf-8' codec can't encode character
    '\\udce9' ...)", naming neither the path nor what is wrong with it."""
    with pytest.raises(OSError) as e:
        build(f"/tmp/{NOT_UTF8}.kv")
    assert e.value.errno == errno.EINVAL
    assert e.value.strerror.endswith(
        ": '/tmp/caf\\xe9.kv' is not UTF-8 text (\\xNN: a byte that is not)"), e.value


@pytest.mark.parametrize(("messages", "says"), [
    ([("user", "hi")], "messages[0] is not a mapping with str 'role' and 'content': "
                       "('user', 'hi')"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "messages[1] is not"),
    ([{"role": "user", "content": 3}], "messages[0] is not"),
    ({"role": "user", "content": "hi"}, "messages[0] is not a mapping with str 'role' and "
                                        "'content': 'role'"),
])
def test_a_chat_message_that_is_not_a_mapping_of_role_and_content_is_einval(messages, says):
    """A tuple was a bare TypeError, "tuple indices must be integers or slices, not str"."""
    with pytest.raises(OSError) as e:
        convert.tokenize(messages=messages, add_generation_prompt=True)
    assert e.value.errno == errno.EINVAL
    assert e.value.strerror.startswith(f"tokenize: {says}"), e.value


def test_a_chat_messages_other_keys_are_not_sent():
    request = convert.tokenize(messages=[{"role": "user", "content": "hi", "name": "x"}]).request
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]


def test_both_clients_refuse_a_tuple_message(k, daemon):
    bad = [("user", "hi")]
    with pytest.raises(OSError, match=r"messages\[0\] is not a mapping") as e:
        k.tokenize(messages=bad, add_generation_prompt=True)
    assert e.value.errno == errno.EINVAL

    async def tokenize() -> None:
        async with await AsyncKernel.connect(daemon.socket, name="test") as a:
            await a.tokenize(messages=bad, add_generation_prompt=True)

    with pytest.raises(OSError, match=r"messages\[0\] is not a mapping") as e:
        asyncio.run(tokenize())
    assert e.value.errno == errno.EINVAL


SHOW_ARGV = """\
import json
from syscalls.client import Kernel
with Kernel.connect() as k:
    print(json.dumps([list(p.argv) for p in k.ps() if p.pid == k.pid][0]))
"""


def test_a_lip_given_an_argument_that_is_not_utf8_runs(daemon, tmp_path):
    """`symphony run lips/complete.py --prompt-file caf\\xe9.txt` failed at attach, exit 1;
    ps shows the argument's byte as \\xNN."""
    prompt = tmp_path / os.fsdecode(b"caf\xe9.txt")
    prompt.write_text("hello")
    out = subprocess.run([*SYMPHONY, "run", "lips/complete.py", "--prompt-file", prompt,
                          "--max-new-tokens", "2"], env=daemon.env(), cwd=ROOT,
                         capture_output=True, timeout=120)
    assert (out.returncode, out.stderr) == (0, b"")
    assert out.stdout.startswith(b"hello")
    (tmp_path / "show.py").write_text(SHOW_ARGV)
    out = subprocess.run([*SYMPHONY, "run", str(tmp_path / "show.py"), b"x\xe9y"],
                         env=daemon.env(), cwd=ROOT, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[1:] == ["x\\xe9y"]


def test_kv_cp_of_a_path_that_is_not_utf8_names_it(daemon, tmp_path):
    """It failed at attach, saying nothing of the path."""
    out = subprocess.run([*SYMPHONY, "kv", "cp", b"kv:/tmp/x\xe9.kv", tmp_path / "o.kv"],
                         env=daemon.env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert out.stderr == ("symphony: kv cp: stat: '/tmp/x\\xe9.kv' is not UTF-8 text (\\xNN: "
                          "a byte that is not): Invalid argument\n")


@pytest.mark.parametrize("command", [
    ["ps"], ["top", "--once", "--interval", "0.01"], ["kv", "ls", "/"],
    ["run", "lips/complete.py", "--prompt", "hello", "--max-new-tokens", "2"],
    ["run", "lips/best_of_n.py", "--prompt", "hello", "--max-new-tokens", "2", "--n", "2"],
    ["--help"], ["kv", "--help"], ["run", "lips/complete.py", "--help"], ["serve", "--help"],
])
def test_a_command_whose_reader_has_gone_stops_quietly(daemon, command):
    """`symphony ps | head -1` said "symphony: Broken pipe", exit 1, or Python's "Exception
    ignored ... BrokenPipeError" at exit: now nothing, exit 141 (128 + SIGPIPE)."""
    out = run_reader_gone([*SYMPHONY, *command], daemon.env())
    assert (out.returncode, out.stderr) == (141, "")


def test_a_kernels_broken_pipe_is_still_reported():
    """The quiet stop is for stdout's reader only: a kernel's EPIPE (it is gone) is said."""
    code = "\n".join([
        "import sys",
        "from syscalls.flags import report",
        "sys.exit(report('p', BrokenPipeError(32, '/k.sock: kernel unreachable')))"])
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stderr) == (1, "p: /k.sock: kernel unreachable: Broken pipe\n")

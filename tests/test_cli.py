"""The `symphony` command's own checks of its flags (no kernel is started)."""

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from daemon import ROOT

from symphony.cli import build_parser
from symphony.control import STATUS_HELLO_TIMEOUT


@pytest.mark.parametrize("flag", ["--token-budget", "--max-seqs", "--max-procs-per-user"])
@pytest.mark.parametrize("command", ["kernel", "start"])
def test_the_kernels_counts_must_be_positive(capsys, command, flag):
    parser = build_parser()
    assert getattr(parser.parse_args([command, flag, "3"]), flag[2:].replace("-", "_")) == 3
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([command, flag, bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("command", ["kernel", "start", "generate"])
def test_weights_are_quantized_unless_float_is_asked(capsys, command):
    from symphony.cli import KERNEL_OPTIONS

    parser = build_parser()
    args = [command] + (["--prompt", "hi"] if command == "generate" else [])
    assert parser.parse_args(args).weights == "quantized"
    assert parser.parse_args(args + ["--weights", "float"]).weights == "float"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(args + ["--weights", "int8"])
    assert e.value.code == 2 and "--weights" in capsys.readouterr().err
    assert "weights" in KERNEL_OPTIONS  # start passes it on to the kernel


@pytest.mark.parametrize("flag,least", [("--kv-pages", 1), ("--host-pages", 0),
                                        ("--disk-pages", 0), ("--quota", 0)])
@pytest.mark.parametrize("command", ["kernel", "start"])
def test_the_kernels_pools_and_quota_are_refused_below_their_least(capsys, command, flag,
                                                                    least):
    """A negative page quota was taken (every pred of a user then failed EDQUOT "page quota
    -3"), and a pool's size below its least failed only once the kernel built it, exit 1
    without the flag's name ("symphony: Invalid argument")."""
    parser = build_parser()
    dest = flag[2:].replace("-", "_")
    for good in (least, 7):
        assert getattr(parser.parse_args([command, flag, str(good)]), dest) == good
    for bad in (str(least - 1), "-3", "x"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([command, flag, bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_run_hands_the_program_its_inherited_file_descriptors(tmp_path):
    """`symphony run P --prompt-file <(...)` as `python P` takes it: a descriptor the shell
    opened (here a pipe's read end, as /dev/fd/N) is open in the program too."""
    program = tmp_path / "cat.py"
    program.write_text("import sys\nprint(open(sys.argv[1]).read(), end='')\n")
    r, w = os.pipe()
    try:
        os.write(w, b"hi\n")
        os.close(w)
        done = subprocess.run(
            [sys.executable, "-m", "symphony.cli", "run", "--socket",
             str(tmp_path / "none.sock"), str(program), f"/dev/fd/{r}"],
            pass_fds=(r,), capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
    finally:
        os.close(r)
    assert (done.returncode, done.stdout, done.stderr) == (0, "hi\n", "")


HUGE = str(10**15)


@pytest.mark.parametrize("args,flag", [
    (["kernel", "--kv-pages", HUGE], f"--kv-pages {HUGE}:"),
    (["kernel", "--kv-pages", "4", "--host-pages", HUGE], f"--host-pages {HUGE}:"),
    (["kernel", "--kv-pages", "4", "--disk-pages", HUGE], f"--disk-pages {HUGE}:"),
    (["generate", "--prompt-ids", "1", "--kv-pages", HUGE], f"--kv-pages {HUGE}:"),
])
def test_a_pool_larger_than_what_holds_it_is_a_usage_error(tmp_path, capsys, args, flag):
    """More bytes than the machine's memory (or the state directory's file system) has in
    all: torch's allocator's traceback, exit 1, naming no flag (or, the CPU's device tier
    being a sparse memfd, a kernel that serves until its pages fill)."""
    from symphony.cli import main

    where = ["--socket", str(tmp_path / "k.sock"), "--state-dir", str(tmp_path / "st")]
    assert main(args + (where if args[0] == "kernel" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"symphony: error: {flag}") and "bytes of KV pages" in err, err


def test_pages_the_allocator_refuses_name_the_flags(tmp_path, capsys, monkeypatch):
    import symphony.engine_process
    from symphony.cli import main

    def refuse(*_, **__):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 8 bytes.\nmore")

    monkeypatch.setattr(symphony.engine_process, "EngineProcess", refuse)
    handler = signal.getsignal(signal.SIGTERM)
    assert main(["kernel", "--socket", str(tmp_path / "k.sock"), "--kv-pages", "7",
                 "--state-dir", str(tmp_path / "state")]) == 1  # not the user's: one may run
    err = capsys.readouterr().err
    assert err.startswith("symphony: --kv-pages 7: the KV pages cannot be allocated "
                          "([enforce fail"), err
    assert "more" not in err
    # Nothing held after: the socket's placeholder, the state directory's lock (this
    # process went on holding them), the SIGTERM handler.
    assert not (tmp_path / "k.sock").exists()
    fd = os.open(tmp_path / "state" / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert signal.getsignal(signal.SIGTERM) is handler


SIGNALLED = """\
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *_: got.append(1))
print("ready", flush=True)
if sys.argv[1] == "group":
    os.killpg(0, signal.SIGINT)
deadline = time.monotonic() + 10
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.5)  # for a second one, were it passed on too
print(len(got))
"""


@pytest.mark.parametrize("whom", ["run", "run from its group", "group"])
def test_run_passes_sigint_on_once(tmp_path, whom):
    """SIGINT sent to run alone was not passed on (SIGTERM and SIGHUP were), and then not
    when its sender was of run's process group (this test, as the serve fixture's SIGTERM:
    the server never stopped); one that reached the program too (here the program's own to
    its group, as a terminal's Ctrl-C reaches the foreground group) is not passed again."""
    program = tmp_path / "sigint.py"
    program.write_text(SIGNALLED)
    run = subprocess.Popen(
        [sys.executable, "-m", "symphony.cli", "run", "--socket", str(tmp_path / "none.sock"),
         str(program), whom.split()[0]],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=whom != "run from its group")
    try:
        assert run.stdout.readline() == "ready\n"
        if whom != "group":
            run.send_signal(signal.SIGINT)
        assert (run.stdout.read(), run.wait(30)) == ("1\n", 0)
    finally:
        run.kill()


@pytest.mark.parametrize("args,flag", [
    (["top", "--once", "--interval", "0"], "--interval"),
    (["top", "--once", "--interval", "-1"], "--interval"),
    (["top", "--once", "--interval", "nan"], "--interval"),
    (["kill", "--", "-5"], "pids"),
    (["kill", "0"], "pids"),
])
def test_values_no_command_can_take_are_usage_errors(capsys, args, flag):
    """They were runtime errors, exit 1: "top: --interval must be positive" (nan was taken,
    and failed in time.sleep), "no process -5" from the kernel."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(args)
    assert e.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_generate_refuses_prompt_ids_outside_the_vocabulary(capsys):
    """It was the engine's "symphony: batch: token id outside the vocabulary", exit 1."""
    from symphony.cli import main

    assert main(["generate", "--prompt-ids", "1,999999999", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err.startswith(
        "symphony: error: --prompt-ids: token 999999999 is outside [0, ")


@pytest.mark.parametrize(("args", "says"), [
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got inf"),
    (["--top-p", "nan"], "argument --top-p: must be a finite number in [0, 1], got nan"),
    (["--min-p=-inf"], "argument --min-p: must be a finite number in [0, 1], got -inf"),
    (["--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
])
def test_a_float_flag_that_is_not_finite_says_so(capsys, args, says):
    """--temperature nan said "must be >= 0, got nan": what was wrong was that it is not a
    finite number."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "--prompt-ids", "1", *args])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(f"error: {says}\n")


def test_top_interval_that_is_not_finite_says_so(capsys):
    """It said "must be a positive number of seconds, got inf"."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["top", "--once", "--interval", "inf"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        "error: argument --interval: must be a finite number of seconds > 0, got inf\n")


def test_a_bare_run_names_only_the_program_as_missing(capsys):
    """It said "the following arguments are required: program, args": args may be empty."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run"])
    assert e.value.code == 2 and capsys.readouterr().err.endswith(
        "error: the following arguments are required: program\n")
    assert build_parser().parse_args(["run", "p.py"]).args == []


def symphony_main(capsys, *args: str) -> tuple[int, str]:
    """`symphony ARGS` in this process: its exit status (argparse's too) and stderr."""
    from symphony.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "usage", "says"), [
    (["kv", "ls", "--bogus"], "symphony kv ls [-h]", "unrecognized arguments: --bogus"),
    (["status", "--bogus"], "symphony status [-h]", "unrecognized arguments: --bogus"),
    (["kv"], "symphony kv [-h]", "the following arguments are required: {ls,cat,cp,rm}"),
    ([], "symphony [-h]", "the following arguments are required: {generate,kernel,start,"),
])
def test_a_usage_error_shows_its_commands_usage_and_names_what_it_lacks(capsys, args, usage,
                                                                        says):
    """An unrecognized argument of a command was said with the top-level usage, and a
    missing command or kv operation as "the following arguments are required: kv_op"."""
    code, err = symphony_main(capsys, *args)
    prog = usage.split(" [")[0]
    assert code == 2 and err.startswith(f"usage: {usage}"), err
    assert f"\n{prog}: error: {says}" in err, err


def test_kill_names_a_bad_pid_a_pid(capsys):
    """`symphony kill 0` said "0 is not a positive count"."""
    assert symphony_main(capsys, "kill", "0") == (2, (
        "usage: symphony kill [-h] [--socket SOCKET] pids [pids ...]\n"
        "symphony kill: error: argument pids: 0 is not a pid (the kernel's pids are 1 or more)\n"))


@pytest.mark.parametrize("command", ["start", "kernel"])
@pytest.mark.parametrize("parent", ["missing/dir", "afile"])
def test_a_socket_in_no_directory_is_refused_naming_the_directory(tmp_path, command, parent):
    """Both made the missing directories (a mistyped --socket left them behind, and a kernel
    served there), and of a file where the directory should be said "File exists"."""
    (tmp_path / "afile").write_text("")
    sock, state = tmp_path / parent / "k.sock", tmp_path / "state"
    out = subprocess.run(
        [sys.executable, "-m", "symphony.cli", command, "--socket", str(sock), "--state-dir",
         str(state), "--kv-pages", "4", "--engine", "sleep:1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    reason = "Not a directory" if parent == "afile" else "No such file or directory"
    assert (out.returncode, out.stdout, out.stderr) == (
        1, "", f"symphony: the socket's directory {sock.parent}: {reason}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("command", [["ps"], ["kv", "ls"], ["kill", "7"], ["status"]])
def test_a_file_at_the_socket_path_is_said_not_a_socket(tmp_path, command):
    """It said "no Symphony kernel at SOCK: No such file or directory" (the hello socket
    beside it was missing), of a file that is there."""
    sock = tmp_path / "k.sock"
    sock.write_text("")
    out = subprocess.run([sys.executable, "-m", "symphony.cli", *command, "--socket", str(sock)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    said = f"no Symphony kernel at {sock}: it is not a socket: Connection refused\n"
    prefix = {"ps": "symphony: ", "kv": "symphony: kv ls: ", "kill": "symphony: ",
              "status": "not running: "}[command[0]]
    if command == ["status"]:
        assert (out.returncode, out.stdout, out.stderr) == (3, prefix + said, "")
    else:
        assert (out.returncode, out.stdout, out.stderr) == (1, "", prefix + said)


def test_status_says_a_kernel_that_answers_no_hello_is_not_answering(tmp_path):
    """A stopped kernel (SIGSTOP), or any listener on its sockets that accepts and answers
    nothing, hung `symphony status` for ever: it gives up after its short bound, status 3."""
    sock = tmp_path / "k.sock"
    listeners = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for listener, path in zip(listeners, (sock, f"{sock}.hello"), strict=True):
            listener.bind(str(path))
            listener.listen()
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "symphony.cli", "status", "--socket",
                              str(sock)], capture_output=True, text=True, timeout=30, cwd=ROOT)
        took = time.monotonic() - start
    finally:
        for listener in listeners:
            listener.close()
    assert (out.returncode, out.stderr) == (3, ""), out
    assert out.stdout == (
        f"not answering: no hello from the kernel at {sock} in {STATUS_HELLO_TIMEOUT:g} s: "
        f"{sock}.hello takes connections but answers none (the kernel is stopped or hung, or "
        "what listens there is no kernel)\n")
    assert took >= STATUS_HELLO_TIMEOUT

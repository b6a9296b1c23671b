"""`symphony kv` and `symphony top` against a real kernel daemon."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
from daemon import ROOT, start_daemon, wait_for

from symphony.top import COLUMNS, WIDTH, Sample, frame, rates
from syscalls.convert import ProcInfo, proc_fields

SYMPHONY = [sys.executable, "-m", "symphony.cli"]
IDS = [(7 * i) % 290 + 6 for i in range(40)]  # 40 tokens: 3 pages of 16

# A LIP that computes tokens until it is killed.
BUSY = """
import os
from syscalls.client import Kernel
k = Kernel.connect(name="busy")
f = k.open("", os.O_RDWR)
ids = [(5 * i) % 290 + 6 for i in range(32)]
f.pred(ids, no_outputs=True)
print(k.pid, flush=True)
while True:
    f.truncate(0)
    f.pred(ids, no_outputs=True)
"""


DAEMON_FLAGS = ("--kv-pages", "128")


@pytest.fixture(scope="module")
def doc(daemon) -> str:
    """A 40-token file in root's home."""
    with daemon.connect() as k:
        path = k.home + "/doc.kv"
        with k.open(path, os.O_CREAT | os.O_RDWR) as f:
            f.pred(IDS, no_outputs=True)
    return path


@pytest.fixture(scope="module")
def busy(daemon):
    lip = subprocess.Popen(
        [sys.executable, "-c", BUSY], env=daemon.env(), cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    yield int(lip.stdout.readline())
    lip.kill()
    lip.wait()


def symphony(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SYMPHONY, *args, "--socket", str(daemon.socket)],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
    )


def kv(daemon, *args: str) -> subprocess.CompletedProcess:
    return symphony(daemon, "kv", *args)


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode()


def refused(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1 and out.stdout == b""
    err = out.stderr.decode()
    assert err.startswith("symphony: ") and "Traceback" not in err, err
    return err


# -- kv ---------------------------------------------------------------------------------


def test_kv_ls_lists_the_home_and_long_form_says_what_stat_says(daemon, doc):
    assert "doc.kv" in ok(kv(daemon, "ls")).split()
    assert ok(kv(daemon, "ls", "kv:/home")).split() == ["root"]
    with daemon.connect() as k:
        st = k.stat(doc)
    (line,) = [
        x for x in ok(kv(daemon, "ls", "-l", "/home/root")).splitlines() if x.endswith(" doc.kv")
    ]
    mode, user, tokens, pages, size, _day, _time, name = line.split()
    assert (mode, user, name) == ("-rw-------", "root", "doc.kv")
    assert (int(tokens), int(pages), int(size)) == (40, 3, st.size)
    # A file lists as itself, under the name it was given.
    assert ok(kv(daemon, "ls", "-l", "doc.kv")).split()[-1] == "doc.kv"
    refused(kv(daemon, "ls", "/nowhere"))


def test_kv_cat_writes_the_exported_bytes(daemon, doc):
    with daemon.connect() as k:
        exported = k.export(doc)
    out = kv(daemon, "cat", doc)
    assert out.returncode == 0 and out.stdout == exported
    assert kv(daemon, "cat", "doc.kv", "kv:doc.kv").stdout == exported * 2
    refused(kv(daemon, "cat", "/home"))


def test_kv_cp_round_trips_through_a_local_file(daemon, doc, tmp_path):
    with daemon.connect() as k:
        exported = k.export(doc)
        ok(kv(daemon, "cp", "kv:doc.kv", str(tmp_path / "doc.kv")))
        assert (tmp_path / "doc.kv").read_bytes() == exported
        ok(kv(daemon, "cp", f"kv:{doc}", str(tmp_path)))  # into a directory: same name
        assert (tmp_path / "doc.kv").read_bytes() == exported
        ok(kv(daemon, "cp", str(tmp_path / "doc.kv"), "kv:back.kv"))
        assert k.export(k.home + "/back.kv") == exported
        with k.open(k.home + "/back.kv") as f:
            assert k.read(f)[0] == IDS
        ok(kv(daemon, "cp", "kv:back.kv", "kv:/tmp"))  # kernel to kernel
        assert k.export("/tmp/back.kv") == exported
        ok(kv(daemon, "cp", "kv:back.kv", str(tmp_path / "again.kv")))
        assert (tmp_path / "again.kv").read_bytes() == exported
        ok(kv(daemon, "rm", "back.kv", "/tmp/back.kv"))
        assert "back.kv" not in [n for n, _ in k.readdir(k.home)]
        assert "back.kv" not in [n for n, _ in k.readdir("/tmp")]


def test_kv_cp_writes_into_a_fifo_or_through_a_symlink_as_cp_does(daemon, doc, tmp_path):
    """The copy was renamed over its destination: `kv cp kv:doc.kv /dev/null`, as root,
    replaced the system's /dev/null with a file (here a FIFO stands for it)."""
    with daemon.connect() as k:
        exported = k.export(doc)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    ok(kv(daemon, "cp", "kv:doc.kv", str(fifo)))
    reader.join(30)
    assert got == [exported] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target, link = tmp_path / "target.kv", tmp_path / "link.kv"
    target.write_bytes(b"old")
    link.symlink_to(target)
    ok(kv(daemon, "cp", "kv:doc.kv", str(link)))
    assert link.is_symlink() and target.read_bytes() == exported


def test_kv_cp_writes_into_an_existing_file_keeping_its_inode_owner_mode_and_links(
        daemon, doc, tmp_path):
    """It was a new file renamed over the old: another owner's file became root's 0640,
    its hard links kept the old bytes, and a file one may not write could be replaced."""
    with daemon.connect() as k:
        exported = k.export(doc)
    dst, link = tmp_path / "dst.kv", tmp_path / "link.kv"
    dst.write_bytes(b"old")
    os.chown(dst, 1234, 1234)
    os.chmod(dst, 0o604)
    os.link(dst, link)
    before = os.stat(dst)
    ok(kv(daemon, "cp", "kv:doc.kv", str(dst)))
    after = os.stat(dst)
    assert (after.st_ino, after.st_uid, after.st_mode) == (before.st_ino, 1234,
                                                             before.st_mode)
    assert dst.read_bytes() == link.read_bytes() == exported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst.kv", "link.kv"]


def test_kv_cp_to_a_name_ending_in_a_slash_needs_a_directory(daemon, doc, tmp_path):
    """As cp(1): it made a file of the name without the slash, locally and in the kernel."""
    assert "Not a directory" in refused(kv(daemon, "cp", "kv:doc.kv", f"{tmp_path}/nd/"))
    assert list(tmp_path.iterdir()) == []
    assert "Not a directory" in refused(kv(daemon, "cp", "kv:doc.kv", "kv:/tmp/nd/"))
    with daemon.connect() as k:
        assert "nd" not in [n for n, _ in k.readdir("/tmp")]


def test_kv_cp_names_the_destination_it_cannot_make(daemon, doc, tmp_path):
    err = refused(kv(daemon, "cp", "kv:doc.kv", f"{tmp_path}/nowhere/a.kv"))
    assert f"{tmp_path}/nowhere/a.kv: No such file or directory" in err and ".a.kv." not in err


def test_kv_cp_copies_between_two_kernels_each_named_by_its_socket(daemon, doc, model):
    """kv:SOCKET:PATH names another kernel's file: between two kernels and within one, in
    either direction, with the default kernel (--socket) named or not; ls, cat and rm take
    it too."""
    other = start_daemon(model, None, "--kv-pages", "64")
    try:
        there = f"kv:{other.socket}:"
        with daemon.connect() as k:
            exported = k.export(doc)
        ok(kv(daemon, "cp", "kv:doc.kv", there + "copy.kv"))  # to the other kernel
        with other.connect() as k2:
            assert k2.export(k2.home + "/copy.kv") == exported
            with k2.open(k2.home + "/copy.kv") as f:
                assert f.read()[0] == IDS
        assert ok(kv(daemon, "ls", there + "/home/root")).split() == ["copy.kv"]
        ok(kv(daemon, "cp", there + "copy.kv", f"kv:{daemon.socket}:/tmp/back.kv"))  # back
        ok(kv(daemon, "cp", there + "copy.kv", there + "/tmp"))  # within the other one
        with daemon.connect() as k, other.connect() as k2:
            assert k.export("/tmp/back.kv") == exported == k2.export("/tmp/copy.kv")
            ok(kv(daemon, "rm", there + "copy.kv", there + "/tmp/copy.kv", "kv:/tmp/back.kv"))
            assert [n for n, _ in k2.readdir(k2.home)] == []
            assert "copy.kv" not in [n for n, _ in k2.readdir("/tmp")]
            assert "back.kv" not in [n for n, _ in k.readdir("/tmp")]
        # A path with a colon whose head is no socket is a path of --socket's kernel.
        assert "No such file" in refused(kv(daemon, "cp", "kv:nowhere:doc.kv", there))
    finally:
        assert other.stop() == 0, other.log_text()


def test_kv_cp_of_a_corrupt_file_is_refused_and_leaves_nothing(daemon, doc, tmp_path):
    with daemon.connect() as k:
        good = k.export(doc)
        before = sorted(n for n, _ in k.readdir(k.home))
        for name, data in [
            ("short.kv", good[:-5]),
            ("garbage.kv", b"not a kv file at all"),
            ("empty.kv", b""),
        ]:
            (tmp_path / name).write_bytes(data)
            err = refused(kv(daemon, "cp", str(tmp_path / name), "kv:"))
            assert "Invalid argument" in err or "kv file" in err, err
            with pytest.raises(FileNotFoundError):
                k.stat(f"{k.home}/{name}")
        assert sorted(n for n, _ in k.readdir(k.home)) == before
    # Export failures leave no local file, not even a partial one.
    refused(kv(daemon, "cp", "kv:missing.kv", str(tmp_path / "out.kv")))
    refused(kv(daemon, "cp", "kv:/home", str(tmp_path / "out.kv")))
    assert not (tmp_path / "out.kv").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.kv", "garbage.kv", "short.kv"]
    assert "kv:PATH" in refused(kv(daemon, "cp", str(tmp_path / "short.kv"), "elsewhere"))
    refused(kv(daemon, "cp", str(tmp_path / "nope"), "kv:"))


def test_kv_rm_removes_what_it_can_and_says_what_it_cannot(daemon, doc):
    with daemon.connect() as k:
        for name in ("a.kv", "b.kv"):
            with k.open(f"{k.home}/{name}", os.O_CREAT | os.O_RDWR) as f:
                f.pred(IDS[:5], no_outputs=True)
        err = refused(kv(daemon, "rm", "a.kv", "nope.kv", f"kv:{k.home}/b.kv", "/home"))
        assert err.splitlines() == [
            "symphony: kv rm: nope.kv: No such file or directory",
            "symphony: kv rm: /home: Is a directory",
        ]
        names = [n for n, _ in k.readdir(k.home)]
        assert "a.kv" not in names and "b.kv" not in names and "doc.kv" in names



def test_kv_cat_and_kill_go_on_past_what_they_cannot_do(daemon):
    """As cat(1) and kill(1): `kv cat a.kv nope a.kv` printed one file and stopped, and
    `symphony kill 9999 PID` left PID running."""
    with daemon.connect() as k:
        with k.open(f"{k.home}/c.kv", os.O_CREAT | os.O_RDWR) as f:
            f.pred(IDS[:5], no_outputs=True)
        one = k.export(f"{k.home}/c.kv")
        out = kv(daemon, "cat", "c.kv", "nope.kv", "c.kv")
        assert out.returncode == 1 and out.stdout == one + one
        assert out.stderr.decode().splitlines() == [
            "symphony: kv cat: nope.kv: No such file or directory"]
        code = ("import time; from syscalls.client import Kernel; "
                "k = Kernel.connect(name='victim'); print(k.getpid(), flush=True); "
                "time.sleep(60)")
        lip = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=daemon.env(),
                               stdout=subprocess.PIPE, text=True)
        try:
            pid = int(lip.stdout.readline())
            out = symphony(daemon, "kill", "99999", str(pid))
            assert out.returncode == 1, out
            assert out.stderr.decode().splitlines() == ["symphony: kill: 99999: No such process"]
            assert lip.wait(30) == -9
        finally:
            lip.kill()
        k.unlink(f"{k.home}/c.kv")

# -- top --------------------------------------------------------------------------------


def proc(pid: int, tokens: int, name: str) -> ProcInfo:
    return ProcInfo(
        pid=pid,
        os_pid=1000 + pid,
        uid=0,
        user="root",
        name=name,
        argv=(name,),
        state="sleeping",
        nice=0,
        syscalls=3,
        tokens=tokens,
        pages=1,
        cpu_seconds=0.5,
        accel_seconds=0.25,
        fds=1,
        started=0.0,
    )


def test_frame_sorts_by_rate_and_shows_what_it_lacks_as_a_dash():
    meminfo = proc_fields(
        "device_total: 8\ndevice_free: 6\ndevice_used: 2\nhost_total: 4\nhost_free: 4\n"
        "host_used: 0\nshared: 1\nquota_alice:   2 / 10\n"
    )
    before = Sample(100.0, [proc(2, 50, "slow"), proc(3, 0, "fast")], meminfo, {})
    after = Sample(
        102.0,
        [*before.procs[:1], proc(3, 400, "fast"), proc(4, 20, "new")],
        meminfo,
        {"run_queue": "1", "tokens_per_s": "210.0", "loop_cpu_us_per_pred": "61.5",
         "engine_busy": "0.93",
         "decode_ahead": "on", "ahead_guesses": "40", "ahead_used": "38"},
    )
    assert rates(before, after) == {2: 0.0, 3: 200.0, 4: 10.0}  # 4 attached in between
    screen = frame(after, rates(before, after))
    assert screen[1:3] == ["KV pages: device 2/8 used, 6 free | host 0/4 used, 4 free",
                           "          shared 1, swapped -, on disk -"]
    assert screen[3].startswith(
        "Sched: run queue 1, waiting for memory -, - steps/s, 210.0 tokens/s"
    )
    assert "engine busy 0.93, loop CPU 61.5 us a pred" in "\n".join(screen)
    assert "decoding ahead on: 38 of 40 guesses taken" in "\n".join(screen)
    assert "Quota (pages used / limit): alice 2 / 10" in screen
    assert [p[-1] for p in process_lines("\n".join(screen))] == ["fast", "new", "slow"]
    assert (
        process_lines("\n".join(screen))[0]
        == "3 root sleeping 0 200.0 400 1 0.5 0.2 fast".split()
    )
    # The first frame has no rates yet.
    assert {p[4] for p in process_lines("\n".join(frame(before, {})))} == {"-"}


def test_frame_fits_80_columns_with_every_column_named():
    """curses writes 79 columns of an 80-column terminal: every line fits them, large
    figures too, and a process line is cut in its NAME only."""
    tiers = "".join(f"{t}_total: 1048576\n{t}_free: 1000000\n{t}_used: 48576\n"
                    for t in ("device", "host", "disk"))
    meminfo = proc_fields(tiers + "shared: 123456\nswapped_out: 123456\non_disk: 123456\n"
                          + "".join(f"quota_user{i}: 12345 / 65536\n" for i in range(6)))
    sched = {name: "123456.7" for name in (
        "run_queue", "waiting_for_memory", "steps_per_s", "tokens_per_s", "batch_seqs_avg",
        "batch_seqs_max", "budget_use", "token_budget", "prefill_share", "queue_delay_p50_ms",
        "queue_delay_p90_ms", "queue_delay_p99_ms", "preemptions", "pages_swapped_out",
        "admission_waits", "engine_busy", "loop_cpu_us_per_pred", "ahead_used",
        "ahead_guesses")} | {"decode_ahead": "on"}
    big = replace(proc(99999, 12345678, "a-long-program-name.py"), user="longusername",
                  state="sleeping", nice=-20, pages=123456, cpu_seconds=9999.9,
                  accel_seconds=9999.9)
    screen = frame(Sample(0.0, [big, proc(2, 5, "x")], meminfo, sched), {99999: 99999.9})
    table = screen.index(COLUMNS)
    assert all(len(line) <= WIDTH for line in screen[:table + 1])
    assert COLUMNS.split() == ["PID", "USER", "STATE", "NI", "TOK/S", "TOKENS", "PAGES", "CPU",
                               "ACCEL", "NAME"]
    name_at = COLUMNS.index("NAME")
    assert WIDTH - name_at >= 10  # room for most of a name
    for line in screen[table + 1:]:
        assert line[name_at - 1] == " " and len(line[:name_at].rstrip()) <= name_at - 1
    assert screen[table + 1][name_at:] == "a-long-program-name.py"
    assert screen[table + 1].split()[:5] == ["99999", "longuser", "sleeping", "-20", "99999.9"]
    summary = " ".join(" ".join(screen[:table]).split())
    for shown in ("device 48576/1048576 used, 1000000 free", "disk 48576/1048576 used",
                  "on disk 123456", "waiting for memory 123456.7", "123456.7 tokens/s",
                  "p99 123456.7 ms", "admission waits 123456.7",
                  "loop CPU 123456.7 us a pred", "123456.7 of 123456.7 guesses taken",
                  "user5 12345 / 65536"):
        assert shown in summary


def process_lines(screen: str) -> list[list[str]]:
    lines = screen.splitlines()
    return [line.split() for line in lines[lines.index(COLUMNS) + 1 :] if line.strip()]


def test_top_once_shows_the_busy_lip_first_with_its_rate(daemon, busy):
    screen = ok(symphony(daemon, "top", "--once", "--interval", "0.5"))
    assert screen.startswith("symphony top - ")
    assert "KV pages: device " in screen and "tokens/s" in screen and "preemptions" in screen
    assert "us a pred, decoding ahead on: " in screen
    procs = process_lines(screen)
    # The busiest first: the only process computing tokens.
    pid, user, _state, _nice, rate, tokens, _pages, cpu, *_, name = procs[0]
    assert (int(pid), user, name) == (busy, "root", "busy")
    assert float(rate) > 0 and int(tokens) > 0 and float(cpu) > 0
    assert "symphony-top" in [p[-1] for p in procs]
    zero = symphony(daemon, "top", "--interval", "0")  # test_cli.py has the other values
    assert zero.returncode == 2 and b"--interval" in zero.stderr
    assert "--once" in refused(symphony(daemon, "top"))  # stdout is no terminal here


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
@pytest.mark.parametrize(("key", "columns"), [("q", 80), ("C-c", 160)])
def test_top_in_a_terminal_draws_and_quits(daemon, busy, tmp_path, key, columns):
    """At 80 columns too: the whole table header, and the busy LIP's name."""
    status = tmp_path / "status"
    # TERM=screen: tmux's own default terminal (tmux-256color) may have no terminfo entry here.
    command = (
        f"cd {shlex.quote(str(ROOT))} && TERM=screen {shlex.join(SYMPHONY)} top "
        f"--socket {shlex.quote(str(daemon.socket))} --interval 0.3; "
        f"echo $? > {shlex.quote(str(status))}"
    )
    tmux = ["tmux", "-L", f"symphony-test-{os.getpid()}", "-f", "/dev/null"]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "top", "-x", str(columns), "-y", "40", command],
        check=True,
    )

    def pane() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "top"], capture_output=True, text=True
        ).stdout

    def busy_has_a_rate() -> bool:
        screen = pane()
        return COLUMNS in screen and any(
            p[0] == str(busy) and p[-1] == "busy" and p[4] != "-" for p in process_lines(screen)
        )

    try:
        wait_for(busy_has_a_rate, what="top to show the busy LIP's rate")
        assert pane().startswith("symphony top - ")
        subprocess.run([*tmux, "send-keys", "-t", "top", key], check=True)
        wait_for(lambda: status.exists() and status.read_text().strip(), what="top to exit")
        assert status.read_text().strip() == "0"
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)

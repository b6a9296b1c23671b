"""The mount's bounds, as an outside tester checked them: a user's spools together hold no
more than docs/architecture.md's figure for its quota; a stopped kernel fails a request
after `symphony mount --timeout` instead of leaving its caller unkillable; `symphony umount`
clears a busy dead mount, as the docs promise."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time

import pytest
from daemon import (
    AS_UID,
    NEEDS_MOUNT,
    ROOT,
    SYMPHONY,
    errno_of,
    make,
    mounted_at,
    run_script,
    wait_for,
    world_dir,
)

from syscalls.convert import proc_fields

QUOTA = 20
DAEMON_FLAGS = ("--kv-pages", "64", "--quota", str(QUOTA))
B = 60021
HOME = "/home/qb"

pytestmark = [pytest.mark.slow, NEEDS_MOUNT]

# As the user argv[1]: the bytes of the file argv[2] written to argv[4] new files named
# argv[3]0.kv, argv[3]1.kv... in 4 KiB writes, all kept open: the bytes taken and the errno
# of the first write refused. Then each is cut to nothing and closed, which imports nothing.
NEW_FILES = AS_UID + """
data, n = open(sys.argv[2], "rb").read(), int(sys.argv[4])
fds = [os.open(f"{sys.argv[3]}{i}.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
       for i in range(n)]
took, refused = 0, None
try:
    for fd in fds:
        for off in range(0, len(data), 4096):
            took += os.write(fd, data[off:off + 4096])
except OSError as e:
    refused = e.errno
for fd in fds:
    os.ftruncate(fd, 0)
    refusal(lambda: os.close(fd))
print(json.dumps([took, refused]))
"""


def test_new_files_spool_at_most_the_documented_bound_for_the_quota(daemon, k, mnt):
    """The tester's files: new ones of 10 pages each (within the quota alone), more than
    the bound holds, written in 4 KiB writes, all open at once. The bound is
    docs/architecture.md's figure, from meminfo: the 8-byte length field, the largest
    header (1 MiB), and every row of the quota's pages an entry, its K and V and 32 bytes.
    (The tester left out the 1 MiB: the code holds to the documented figure.)"""
    mem = proc_fields(k.procfs("meminfo"))
    page_size, page_bytes = int(mem["page_size_tokens"]), int(mem["page_bytes"])
    bound = 8 + (1 << 20) + QUOTA * page_size * (page_bytes // page_size + 32)
    k.mkdir(HOME, 0o755)
    k.chown(HOME, B, B)
    make(k, "/tmp/ten.kv", 10 * page_size)
    source = world_dir() / "ten.kv"
    source.write_bytes(k.export("/tmp/ten.kv"))
    source.chmod(0o644)
    files = bound // source.stat().st_size + 2
    took, refused = json.loads(run_script(
        daemon, NEW_FILES, str(B), str(source), f"{mnt}{HOME}/t", str(files)))
    assert refused == errno.EDQUOT
    assert bound - 4096 < took <= bound, (took, bound)
    assert k.readdir(HOME) == []


def mount_at(daemon, target, *flags: str) -> None:
    """`symphony mount` (it returns once mounted) at target, a fresh directory."""
    target.mkdir()
    subprocess.run([*SYMPHONY, "mount", str(target), "--socket", str(daemon.socket), *flags],
                   cwd=ROOT, check=True, timeout=60)
    assert mounted_at(target)


def umount(target) -> subprocess.CompletedProcess:
    return subprocess.run([*SYMPHONY, "umount", str(target)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_stopped_kernel_fails_a_request_after_the_timeout(daemon):
    """ls of a mount whose kernel was stopped (SIGSTOP) waited for it for ever, in D
    state, kill -9 or not."""
    target = daemon.socket.parent / "mnt-timeout"
    mount_at(daemon, target, "--timeout", "2")
    try:
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            ls = subprocess.Popen(["ls", target / "home"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
            try:
                _, err = ls.communicate(timeout=30)
            finally:  # frees an ls still waiting, so that it can be reaped
                daemon.process.send_signal(signal.SIGCONT)
                if ls.poll() is None:
                    ls.kill()
                    ls.wait()
            took = time.monotonic() - start
        finally:
            daemon.process.send_signal(signal.SIGCONT)
        assert ls.returncode != 0 and "Connection timed out" in err, err
        assert 2 <= took < 15, took
        # The kernel runs again: so does the mount.
        assert subprocess.run(["ls", target / "home"], timeout=30).returncode == 0
    finally:
        done = umount(target)
        assert done.returncode == 0, done.stderr


def test_umount_clears_a_dead_mount_with_a_file_open_in_it(daemon, k):
    """fusermount3 -u said EBUSY, and the dead mount stayed."""
    make(k, "/tmp/held.kv", 5)
    target = daemon.socket.parent / "mnt-dead"
    target.mkdir()
    mount = subprocess.Popen([*SYMPHONY, "mount", str(target), "--socket", str(daemon.socket),
                              "--foreground"], cwd=ROOT)
    holder = None
    try:
        wait_for(lambda: mounted_at(target) or mount.poll() is not None, what="the mount")
        with open(target / "tmp/held.kv", "rb") as held:
            holder = subprocess.Popen(["sleep", "60"], stdin=held)
        mount.kill()
        mount.wait()
        wait_for(lambda: errno_of(os.stat, target) == errno.ENOTCONN, what="ENOTCONN")
        done = umount(target)
        assert done.returncode == 0, done.stderr
        assert "detached lazily" in done.stderr
        assert not mounted_at(target)
        subprocess.run([*SYMPHONY, "mount", str(target), "--socket", str(daemon.socket)],
                       cwd=ROOT, check=True, timeout=60)
        assert mounted_at(target) and "tmp" in os.listdir(target)
        done = umount(target)
        assert done.returncode == 0 and done.stderr == "", done.stderr
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        if mount.poll() is None:
            mount.kill()
            mount.wait()
        if mounted_at(target):
            subprocess.run(["fusermount3", "-u", "-z", str(target)])

"""Writing through the mount under a page quota: a file whose header declares more pages
than its owner's quota is refused as its header is written (EDQUOT, as the kernel's import
refuses it), not after its bytes are spooled, and a user's open writers together spool no
more than the largest file its quota could hold; root's spools are bounded as before."""

from __future__ import annotations

import errno
import json
import os

import pytest
from daemon import AS_UID, NEEDS_MOUNT, as_user, make, run_script, world_dir
from test_mount import declaring

from kvfs.kv_header import largest_file, read_header
from syscalls.convert import proc_fields

QUOTA = 6
DAEMON_FLAGS = ("--kv-pages", "512", "--quota", str(QUOTA))
A = 60001
HOME = "/home/qa"
OWN = f"{HOME}/own.kv"  # A's file of 9 entries (1 page): meminfo shows A's quota

pytestmark = [pytest.mark.slow, NEEDS_MOUNT]

# As the user argv[1]: open the file argv[2] for writing (O_TRUNC) and write the header
# argv[3] (hex) in two writes, its first 8 bytes then the rest, then 4 KiB of zeros, then
# close: each call's errno (null: it succeeded), as JSON.
HEADER_WRITES = AS_UID + """
header = bytes.fromhex(sys.argv[3])
fd = os.open(sys.argv[2], os.O_WRONLY | os.O_TRUNC)
calls = [lambda: os.write(fd, header[:8]), lambda: os.write(fd, header[8:]),
         lambda: os.write(fd, bytes(4096)), lambda: os.close(fd)]
print(json.dumps([(refusal(c) or [None])[0] for c in calls]))
"""
# As the user argv[1]: open the file argv[2] for writing (O_TRUNC) argv[3] times, and write
# to each in turn the header argv[4] (hex) and then zeros in 64 KiB writes up to the size
# argv[5]: the bytes each open took, and the errno of the first write refused (null if
# none). Then each is cut to nothing and closed, which imports nothing.
WRITERS = AS_UID + """
path, n, header, size = sys.argv[2], int(sys.argv[3]), bytes.fromhex(sys.argv[4]), int(sys.argv[5])
fds = [os.open(path, os.O_WRONLY | os.O_TRUNC) for _ in range(n)]
took, refused = [0] * n, None
for i, fd in enumerate(fds):
    try:
        took[i] += os.write(fd, header)
        while took[i] < size:
            took[i] += os.write(fd, bytes(min(1 << 16, size - took[i])))
    except OSError as e:
        refused = refused or e.errno
for fd in fds:
    os.ftruncate(fd, 0)
    refusal(lambda: os.close(fd))
print(json.dumps([took, refused]))
"""


@pytest.fixture(scope="module")
def blob(daemon) -> bytes:
    """A's home, its file OWN (so meminfo shows its quota), and that file's bytes."""
    with daemon.connect() as k:
        k.mkdir(HOME, 0o755)
        k.chown(HOME, A, A)
        make(k, OWN, 9)
        k.chown(OWN, A, A)
        assert proc_fields(k.procfs("meminfo"))[f"quota_uid{A}"] == f"1 / {QUOTA}"
        return k.export(OWN)


def header_writes(daemon, uid: int, path: str, header: bytes) -> list[int | None]:
    return json.loads(run_script(daemon, HEADER_WRITES, str(uid), path, header.hex()))


def test_a_header_past_the_owners_quota_fails_as_it_is_written(daemon, k, mnt, blob):
    own = str(mnt) + OWN
    # Declaring QUOTA pages is within it: the writes are taken (the close imports a file
    # with no body, which the kernel refuses: EINVAL).
    fits = declaring(blob, QUOTA * 16)
    assert header_writes(daemon, A, own, fits) == [None, None, None, errno.EINVAL]
    # One entry more: the write that completes the header fails, and so does every later
    # one and the close; the file is as it was.
    over = declaring(blob, QUOTA * 16 + 1)
    assert header_writes(daemon, A, own, over) == [None] + [errno.EDQUOT] * 3
    assert k.export(OWN) == blob
    # Root writing A's file is held to A's quota, as the kernel's import charges the owner.
    fd = os.open(own, os.O_WRONLY | os.O_TRUNC)
    assert os.write(fd, over[:8]) == 8
    with pytest.raises(OSError) as e:
        os.write(fd, over[8:])
    assert e.value.errno == errno.EDQUOT
    with pytest.raises(OSError) as e:
        os.close(fd)
    assert e.value.errno == errno.EDQUOT
    assert k.export(OWN) == blob
    # A file of root's own has no quota: the header is taken.
    make(k, f"{HOME}/root.kv", 9)
    assert header_writes(daemon, 0, str(mnt) + f"{HOME}/root.kv", over) == [
        None, None, None, errno.EINVAL]


def test_cp_of_a_file_past_the_quota_fails_at_its_first_write(daemon, k, mnt, blob):
    # The outside tester's file: a header of 1400 entries (88 pages), and the bytes it
    # lays out after it.
    header = declaring(blob, 1400)
    source = world_dir() / "n1400.kv"
    source.write_bytes(header + bytes(read_header(header, None).size - len(header)))
    source.chmod(0o644)
    cp = as_user(A, "cp", str(source), str(mnt) + OWN)
    assert cp.returncode == 1
    # Refused as the header is written, not at close once all is spooled.
    assert b"error writing" in cp.stderr and b"Disk quota exceeded" in cp.stderr, cp.stderr
    assert k.export(OWN) == blob


def test_a_users_writers_together_spool_no_more_than_its_quota_could_hold(
    daemon, k, mnt, blob
):
    mem = proc_fields(k.procfs("meminfo"))
    page_size, page_bytes = int(mem["page_size_tokens"]), int(mem["page_bytes"])
    bound = largest_file(QUOTA, page_size, page_bytes)
    header = declaring(blob, QUOTA * page_size)  # each within the quota alone
    size = read_header(header, None).size
    writers = bound // size + 2  # more than the bound holds, each file whole
    # A's writers of one file (no inode quota to meet), each opened with O_TRUNC.
    took, refused = json.loads(run_script(
        daemon, WRITERS, str(A), str(mnt) + OWN, str(writers), header.hex(), str(size)))
    assert refused == errno.EDQUOT
    assert took[0] == size and bound - size < sum(took) <= bound, (took, bound)
    assert k.export(OWN) == blob
    # Root's are bounded as before: by the largest file the pool could hold.
    make(k, f"{HOME}/root-writers.kv", 9)
    took, refused = json.loads(run_script(
        daemon, WRITERS, "0", str(mnt) + f"{HOME}/root-writers.kv", str(writers),
        header.hex(), str(size)))
    assert (took, refused) == ([size] * writers, None)


def test_a_file_within_the_quota_still_copies_in(daemon, k, mnt, blob):
    make(k, "/tmp/other.kv", 20, salt=3)  # 2 pages
    data = k.export("/tmp/other.kv")
    source = world_dir() / "other.kv"
    source.write_bytes(data)
    source.chmod(0o644)
    cp = as_user(A, "cp", str(source), str(mnt) + f"{HOME}/copy.kv")
    assert cp.returncode == 0, cp.stderr
    assert k.export(f"{HOME}/copy.kv") == data
    assert k.stat(f"{HOME}/copy.kv").uid == A


def test_meminfo_shows_the_quota_of_a_user_that_holds_no_page_yet(daemon):
    """Only users that had held a page had a line: the mount could not learn a new user's
    quota before its first import."""
    run_script(daemon, AS_UID + "Kernel.connect(name='new')\n", str(A + 7))
    with daemon.connect() as k:
        assert proc_fields(k.procfs("meminfo"))[f"quota_uid{A + 7}"] == f"0 / {QUOTA}"


# As the user argv[1]: write the file argv[3] to the new file argv[2] through one open
# description and a dup of it, close the dup, remove the file argv[4] (giving a page
# back), close the other: each close's errno (null: it succeeded), and whether the new
# file is there.
DUP_CLOSES = AS_UID + """
path, source, filler = sys.argv[2], sys.argv[3], sys.argv[4]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, open(source, "rb").read())
dup = os.dup(fd)
first = (refusal(lambda: os.close(dup)) or [None])[0]
os.unlink(filler)
second = (refusal(lambda: os.close(fd)) or [None])[0]
print(json.dumps([first, second, os.path.exists(path)]))
"""


def test_a_close_after_another_close_of_the_file_failed_imports_it_again(
    daemon, k, mnt, blob
):
    """A close that imported nothing (EDQUOT) forgot the writes: the close of the file's
    other descriptor (a dup, a child's copy) returned 0 and no file was made."""
    filler = f"{HOME}/filler.kv"
    make(k, filler, 9)  # one page of A's
    k.chown(filler, A, A)
    mem = proc_fields(k.procfs("meminfo"))
    pages = QUOTA - int(mem[f"quota_uid{A}"].split(" / ")[0]) + 1  # past it, till the filler goes
    make(k, "/tmp/dup-source.kv", pages * int(mem["page_size_tokens"]), salt=5)
    source = world_dir() / "dup-source.kv"
    source.write_bytes(k.export("/tmp/dup-source.kv"))
    source.chmod(0o644)
    first, second, there = json.loads(run_script(
        daemon, DUP_CLOSES, str(A), str(mnt) + f"{HOME}/dup.kv", str(source),
        str(mnt) + filler))
    assert (first, second, there) == (errno.EDQUOT, None, True)
    assert k.export(f"{HOME}/dup.kv") == source.read_bytes()

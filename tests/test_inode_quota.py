"""The inode quota on a real kernel (`symphony kernel --inode-quota N`): a user other than
root past it gets EDQUOT, with the user and the limit in the message, through the client;
/proc/meminfo shows the count."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon import AS_UID, NEEDS_MOUNT, ROOT, as_user, make

from syscalls.convert import proc_fields

pytestmark = pytest.mark.slow
LIMIT = 4
UID = 60021
DAEMON_FLAGS = ("--kv-pages", "512", "--inode-quota", str(LIMIT))
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")

# As the user.
BODY = AS_UID + """
k = Kernel.connect(name="inodes")  # its home: 1
k.mkdir(k.home + "/d")  # 2
k.open(k.home + "/f", os.O_CREAT | os.O_RDWR).close()  # 3
anon = k.open("")  # 4
anon.pred([5, 6, 7], no_outputs=True)
out = {"create": refusal(lambda: k.open(k.home + "/g", os.O_CREAT | os.O_RDWR)),
       "mkdir": refusal(lambda: k.mkdir(k.home + "/e")),
       "anonymous": refusal(lambda: k.open("")),
       "fork": refusal(lambda: anon.fork()),
       "export": len(k.export(anon)),  # its snapshot is never refused
       "meminfo": k.procfs("meminfo"), "home": k.home}
anon.close()
k.open(k.home + "/g", os.O_CREAT | os.O_RDWR).close()  # room again
out["again"] = refusal(lambda: k.mkdir(k.home + "/e"))
print(json.dumps(out))
"""


@NEEDS_ROOT
def test_a_user_past_its_inode_quota_gets_edquot_through_the_client(daemon):
    out = subprocess.run([sys.executable, "-c", BODY, str(UID)], env=daemon.env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    for call in ("create", "mkdir", "anonymous", "fork", "again"):
        code, message = got[call]
        assert code == errno.EDQUOT, (call, message)
        assert f"uid {UID} inode quota {LIMIT}" in message, (call, message)
    assert got["export"] > 0
    fields = proc_fields(got["meminfo"])
    user = next(key for key in fields if key.startswith("inodes_") and str(UID) in key)
    assert fields[user] == f"{LIMIT} / {LIMIT}"
    with daemon.connect("root") as k:  # root is not limited; the refused left nothing
        assert sorted(name for name, _ in k.readdir(got["home"])) == ["d", "f", "g"]
        for i in range(LIMIT + 2):
            k.mkdir(f"/root-dir-{i}")
        assert proc_fields(k.procfs("meminfo"))[user] == f"{LIMIT} / {LIMIT}"
        assert proc_fields(k.procfs("meminfo"))["inodes_root"].endswith(" / -")


@NEEDS_ROOT
@NEEDS_MOUNT
def test_the_mount_says_edquot_for_mkdir_past_the_quota(daemon, mnt):
    """The mount makes directories with the same kvfs call: past the quota, mkdir(1) fails
    with "Disk quota exceeded"."""
    uid = UID + 1
    for i in range(LIMIT):
        made = as_user(uid, "mkdir", str(mnt / f"tmp/ino{i}"))
        assert made.returncode == 0, made.stderr
    refused = as_user(uid, "mkdir", str(mnt / "tmp/one-more"))
    assert refused.returncode != 0
    assert os.strerror(errno.EDQUOT) in refused.stderr.decode(), refused.stderr
    assert not (mnt / "tmp/one-more").exists()
    assert as_user(uid, "rmdir", str(mnt / "tmp/ino0")).returncode == 0
    made = as_user(uid, "mkdir", str(mnt / "tmp/one-more"))
    assert made.returncode == 0, made.stderr


@NEEDS_ROOT
@NEEDS_MOUNT
def test_a_user_at_its_quota_still_reads_through_the_mount(daemon, mnt):
    """The mount's read-open forks a snapshot as the reader, which the quota refuses: at
    the limit it reads the file itself instead, each export stream its own snapshot."""
    uid = UID + 2
    with daemon.connect("root") as k:
        make(k, "/tmp/readable.kv", 40)
        want = k.export("/tmp/readable.kv")
    for i in range(LIMIT):
        assert as_user(uid, "mkdir", str(mnt / f"tmp/full{i}")).returncode == 0
    refused = as_user(uid, "mkdir", str(mnt / "tmp/full-past"))
    assert os.strerror(errno.EDQUOT) in refused.stderr.decode()  # at the limit indeed
    read = as_user(uid, "cat", str(mnt / "tmp/readable.kv"))
    assert read.returncode == 0, read.stderr
    assert read.stdout == want


@NEEDS_ROOT
@NEEDS_MOUNT
def test_cp_into_the_mount_past_the_quota_fails_creating_the_file(daemon, mnt, tmp_path):
    """A new file written through the mount takes its inode when it imports, on close:
    past the quota, cp fails as it creates the file ("cannot create regular file"), not
    after writing it all ("failed to close"), and leaves nothing."""
    uid = UID + 3
    source = Path(tempfile.mkdtemp(dir="/tmp")) / "source.kv"  # a place the user may read
    try:
        with daemon.connect("root") as k:
            make(k, "/tmp/quota-source.kv", 40)
            source.write_bytes(k.export("/tmp/quota-source.kv"))
        source.parent.chmod(0o755)
        source.chmod(0o644)
        for i in range(LIMIT - 1):
            assert as_user(uid, "mkdir", str(mnt / f"tmp/q{i}")).returncode == 0
        copied = as_user(uid, "cp", str(source), str(mnt / "tmp/q-last.kv"))  # the last one
        assert copied.returncode == 0, copied.stderr
        refused = as_user(uid, "cp", str(source), str(mnt / "tmp/q-past.kv"))
        said = refused.stderr.decode()
        assert refused.returncode != 0
        assert "cannot create regular file" in said and os.strerror(errno.EDQUOT) in said, said
        assert not (mnt / "tmp/q-past.kv").exists()
    finally:
        shutil.rmtree(source.parent)

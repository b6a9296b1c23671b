"""The page quota across users on a real kernel (`symphony kernel --quota N`): a page shared
by two users' files is charged to each, so a user that forks another's readable file and
links the fork cannot leave the pages on the other's quota (kvfs/pages.py); /proc/meminfo
shows each user's charge, and reading through the mount at the quota still works."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from daemon import AS_UID, NEEDS_MOUNT, ROOT, as_user

from syscalls.convert import proc_fields

pytestmark = pytest.mark.slow
QUOTA = 8
ALICE, BOB = 60031, 60032
DAEMON_FLAGS = ("--kv-pages", "512", "--quota", str(QUOTA))
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")

# As the user; then one step of the story (argv[2]).
BODY = AS_UID + """
step = sys.argv[2]
k = Kernel.connect(name="quota")
size = k.model_info().page_size
def fill(f, pages):
    f.pred([(7 * i) % 50 + 10 for i in range(pages * size)], no_outputs=True)
out = {"home": k.home}
if step == "make":  # alice: a 6-page file others may read
    with k.open(k.home + "/f", os.O_CREAT | os.O_RDWR, 0o644) as f:
        fill(f, 6)
elif step == "take":  # bob: a fork of it, named
    with k.open("/home/" + sys.argv[3] + "/f") as f, f.fork() as g:
        g.link(k.home + "/x")
    with k.open(k.home + "/y", os.O_CREAT | os.O_RDWR) as y:  # at his quota: 6 + 2
        fill(y, 2)
elif step == "again":  # alice: her file gone, her whole quota is hers again
    k.unlink(k.home + "/f")
    with k.open(k.home + "/g", os.O_CREAT | os.O_RDWR, 0o644) as g:
        out["fill"] = refusal(lambda: fill(g, 8))
out["meminfo"] = proc_fields(k.procfs("meminfo"))
print(json.dumps(out))
"""


def run(uid: int, *args: str, env) -> dict:
    out = subprocess.run([sys.executable, "-c", BODY, str(uid), *args], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def quota_line(meminfo: dict, uid: int) -> str:
    return next(v for key, v in meminfo.items() if key.startswith("quota_") and str(uid) in key)


@pytest.fixture(scope="module")
def story(daemon) -> dict:
    """Alice makes a 6-page file others may read; bob forks it, links the fork and fills
    his quota; alice unlinks hers and fills 8 pages anew. Each step's output, by name."""
    alice = run(ALICE, "make", env=daemon.env())
    user = alice["home"].rsplit("/", 1)[1]
    return {"bob": run(BOB, "take", user, env=daemon.env()),
            "again": run(ALICE, "again", env=daemon.env())}


@NEEDS_ROOT
def test_a_fork_of_anothers_file_linked_leaves_nothing_on_its_quota(story):
    mem = story["bob"]["meminfo"]
    assert quota_line(mem, ALICE) == f"6 / {QUOTA}"
    assert quota_line(mem, BOB) == f"8 / {QUOTA}"  # the 6 pages he shares, and 2 his own
    assert int(mem["shared"]) == 6
    again = story["again"]
    assert again["fill"] is None, again["fill"]  # 8 pages: before, EDQUOT at 6 + 8
    assert quota_line(again["meminfo"], ALICE) == f"8 / {QUOTA}"
    assert quota_line(again["meminfo"], BOB) == f"8 / {QUOTA}"
    assert int(again["meminfo"]["shared"]) == 0  # bob's pages are his alone now


@NEEDS_ROOT
@NEEDS_MOUNT
def test_a_user_at_its_page_quota_still_reads_anothers_file_through_the_mount(
        daemon, mnt, story):
    """Bob is at his page quota (the story): the mount's snapshot fork of alice's 8-page
    file would charge him 8 pages more, and is refused; the mount then reads the file
    itself, each export stream a snapshot that is never refused."""
    with daemon.connect("root") as k:
        home = next(f"/home/{n}" for n, _ in k.readdir("/home")
                    if k.stat(f"/home/{n}").uid == ALICE)
        want = k.export(f"{home}/g")
        assert quota_line(proc_fields(k.procfs("meminfo")), BOB) == f"8 / {QUOTA}"
    read = as_user(BOB, "cat", str(mnt / home.lstrip("/") / "g"))
    assert read.returncode == 0, read.stderr
    assert read.stdout == want

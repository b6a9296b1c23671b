"""Who may do what: credentials and the POSIX permission rules."""

from __future__ import annotations

import errno
import stat
from dataclasses import dataclass, field

from kvfs.errors import FSError
from kvfs.inode import Inode

R, W, X = 4, 2, 1
# The largest uid or gid the kernel keeps: its protocol carries ids as int32 (uid_t goes
# to 2**32 - 2, past which an id could be neither stored in nor sent from a file's stat).
ID_MAX = (1 << 31) - 1


def check_ids(uid: int, gid: int, what: str, leave: bool = False) -> None:
    """EINVAL unless uid and gid are in [0, ID_MAX] (or -1, "leave it", with `leave`)."""
    for name, n in (("uid", uid), ("gid", gid)):
        if not (0 <= n <= ID_MAX or (leave and n == -1)):
            raise FSError(errno.EINVAL, f"{what}: {name} {n} is not in [0, {ID_MAX}]"
                          + (" (or -1: leave it)" if leave else ""))


@dataclass(frozen=True)
class Cred:
    """An identity as the operating system vouched for it (never taken from a request)."""

    uid: int
    gid: int
    groups: frozenset[int] = field(default_factory=frozenset)

    @property
    def root(self) -> bool:
        return self.uid == 0

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


ROOT = Cred(0, 0)


def allowed(cred: Cred, inode: Inode, want: int) -> bool:
    """Owner, group or other bits, whichever class the caller falls in first; root passes."""
    if cred.root:
        return True
    if cred.uid == inode.uid:
        bits = inode.perm >> 6
    elif cred.in_group(inode.gid):
        bits = inode.perm >> 3
    else:
        bits = inode.perm
    return bits & want == want


def check(cred: Cred, inode: Inode, want: int, what: str) -> None:
    if not allowed(cred, inode, want):
        raise FSError(errno.EACCES, what)


def check_sticky(cred: Cred, directory: Inode, victim: Inode, what: str) -> None:
    """In a sticky directory (/tmp) only the owner of the entry or of the directory may
    remove or rename it."""
    if directory.mode & stat.S_ISVTX and not (
        cred.root or cred.uid in (victim.uid, directory.uid)
    ):
        raise FSError(errno.EPERM, f"{what}: sticky directory, not the owner")

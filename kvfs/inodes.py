"""Inode quotas: how many inodes each user owns, and how many it may own.

Every inode counts against its owner (inode.uid): named files and directories, anonymous
files, forks, export snapshots, the home made on first attach. An inode is given back when
it dies: a file with neither a name nor an open handle, a removed directory. chown moves
the count to the new owner. Root (uid 0) is counted but never limited. Without a limit a
user other than root could make empty files without end, each an Inode in the kernel's
memory (and a name in the state directory), until the kernel ran out of memory.
"""

from __future__ import annotations

import errno

from kvfs.errors import FSError

DEFAULT_INODE_QUOTA = 65536  # inodes per user other than root (`symphony kernel --inode-quota`)


class InodeQuota:
    def __init__(self, default: int | None = DEFAULT_INODE_QUOTA,
                 limits: dict[int, int] | None = None):
        self.default, self.limits = default, dict(limits or {})
        self.used: dict[int, int] = {}  # uid -> live inodes it owns

    def limit(self, uid: int) -> int | None:
        return None if uid == 0 else self.limits.get(uid, self.default)

    def check(self, uid: int, what: str, n: int = 1) -> None:
        """Fail with EDQUOT, changing nothing, when uid may not own n more inodes."""
        limit, used = self.limit(uid), self.used.get(uid, 0)
        if limit is not None and used + n > limit:
            raise FSError(errno.EDQUOT, f"{what}: uid {uid} inode quota {limit} "
                          f"({used} inodes used)")

    def add(self, uid: int, n: int = 1) -> None:
        self.used[uid] = self.used.get(uid, 0) + n

    def drop(self, uid: int, n: int = 1) -> None:
        left = self.used.get(uid, 0) - n
        if left > 0:
            self.used[uid] = left
        else:
            self.used.pop(uid, None)

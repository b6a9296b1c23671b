"""The kernel daemon's settings, with their defaults stated once (the CLI's flags use them).

Kept free of heavy imports, so that `symphony --help` need not load torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# How long the ranks of a kernel's engine wait for one another to come (symphony/ranks.py),
# the nodes of a multi-node kernel started in either order.
RENDEZVOUS_SECONDS = 600.0


@dataclass
class Options:
    socket: Path
    state_dir: Path
    token_budget: int = 512  # tokens per forward pass
    max_seqs: int = 256  # sequences per forward pass
    disk_pages: int = 0
    quota: int | None = None  # pages per user (root has none)
    inode_quota: int = 65536  # inodes per user (root has none); 0: no limit
    decode_ahead: bool = True  # compute a decoding LIP's next pred before it comes
    pipeline: bool = True  # send the next step to the engine before the one in flight ends
    max_procs_per_user: int = 256  # sessions a user other than root may hold at once

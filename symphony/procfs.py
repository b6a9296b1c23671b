"""The text of /proc entries: what `procfs(path)` returns and what the mount shows."""

from __future__ import annotations

import errno
import time
from typing import TYPE_CHECKING

from kvfs.errors import FSError
from kvfs.perm import Cred
from kvfs.pool import DISK, TIERS
from symphony.process import Process
from symphony.sched_stats import RankClock
from syscalls.users import user_name

if TYPE_CHECKING:
    from kvfs.pages import Page
    from symphony.daemon import Kernel


FILES = ("kv", "meminfo", "sched")
PROC_FILES = ("fds", "status", "syscalls")
PUBLIC = ("status",)  # what other users may read of a process (without its argv)
PID_DIGITS = 18  # longer names are no pid (and int() refuses over 4300 digits)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lines(pairs: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in pairs) + 2
    return "".join(f"{k + ':':<{width}}{v}\n" for k, v in pairs)


class ProcFS:
    def __init__(self, kernel: Kernel):
        self.k = kernel
        self.clock = RankClock()

    def read(self, path: str, cred: Cred) -> str:
        """The text of a file as `cred` may see it; for a directory, its entries a line
        each, subdirectories ending in "/". Another user's PID/fds and PID/syscalls are
        EACCES, and left out of PID/'s listing (the mount reads every entry it lists); its
        status has no argv."""
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["proc"]:
            parts = parts[1:]
        where = f"/proc/{'/'.join(parts)}"
        if not parts:
            return "".join(f"{name}\n" for name in FILES) + "".join(
                f"{p.pid}/\n" for p in self.k.procs)
        if len(parts) == 1 and parts[0] in FILES:
            return getattr(self, parts[0])()
        proc = self.process(parts[0])
        if proc is None or len(parts) > 2 or parts[1:] and parts[1] not in PROC_FILES:
            raise FSError(errno.ENOENT, where)
        mine = proc.inspectable_by(cred)
        if len(parts) == 1:
            return "".join(f"{name}\n" for name in PROC_FILES if mine or name in PUBLIC)
        if not (mine or parts[1] in PUBLIC):
            raise FSError(errno.EACCES, f"{where}: process {proc.pid} is another user's")
        if parts[1] == "status":
            return self.status(proc, mine)
        return getattr(self, parts[1])(proc)

    def process(self, name: str) -> Process | None:
        """The process a /proc name stands for: a pid in ASCII digits as str() writes it
        (not "03", "²" or "٣", which int() would take)."""
        if not (name.isascii() and name.isdigit()) or len(name) > PID_DIGITS:
            return None
        pid = int(name)
        return self.k.procs.by_pid.get(pid) if str(pid) == name else None

    def meminfo(self) -> str:
        store = self.k.fs.store
        pairs: list[tuple[str, object]] = []
        for tier in TIERS:
            total, free = store.capacity(tier), store.free_in(tier)
            pairs += [(f"{tier}_total", total), (f"{tier}_free", free),
                      (f"{tier}_used", total - free)]
        pairs.append(("page_size_tokens", self.k.fs.page_size))
        pairs.append(("page_bytes", self.k.engine.pool.page_bytes))
        pairs.append(("shared", sum(p.refs > 1 for p in store.live)))
        pairs.append(("swapped_out", sum(p.tier != "device" for p in store.live)))
        pairs.append(("on_disk", sum(p.tier == DISK for p in store.live)))
        inodes = self.k.fs.inodes
        # Every user with a home (it owns an inode) has a quota line, 0 until it holds a
        # page: the mount reads the limit here before the user's first write. The charge
        # is what the quota checks: restored files not loaded yet count (pages.py).
        for uid in sorted(store.used.keys() | inodes.used.keys()):
            limit = store.limit(uid)
            pairs.append((f"quota_{user_name(uid)}",
                          f"{store.charged(uid)} / {limit if limit is not None else '-'}"))
        for uid, used in sorted(inodes.used.items()):
            limit = inodes.limit(uid)
            pairs.append((f"inodes_{user_name(uid)}",
                          f"{used} / {limit if limit is not None else '-'}"))
        return lines(pairs)

    def sched(self) -> str:
        s = self.k.sched
        st = s.stats
        # Rates over the steps of the last STATS_WINDOW seconds, from the first one's start
        # to now: they fall to 0 when the kernel goes idle.
        recent, window = st.window(time.monotonic())
        tokens = [r.prefill + r.decode for r in recent]
        prefill = sum(r.prefill for r in recent)
        preds = recent[-1].preds - recent[0].preds if recent else 0
        loop_cpu = recent[-1].loop_cpu - recent[0].loop_cpu if recent else 0.0
        delays = list(st.delays)
        engine = self.k.engine
        pairs: list[tuple[str, object]] = [
            # Which code runs the forward passes: the figures below depend on it.
            ("engine", f"{engine.device.type} {str(engine.dtype).removeprefix('torch.')}, "
                       f"attention {engine.attention}"),
            # --engine: "model", or "sleep:MS", a simulated accelerator (no forward passes).
            ("engine_mode", engine.mode),
            # The process that runs them (engine_process.py): its CPU is not the kernel's.
            ("engine_pid", engine.pid),
            # Its nice value: DRIVER_NICE when it drives an accelerator (engine_process.py).
            ("engine_nice", "-" if (nice := engine.nice()) is None else nice),
            # Its ranks (symphony.ranks): each one's pid, machine and device, and its busy
            # share (CPU seconds per second over the window; "-" off this machine).
            ("tensor_parallel", len(engine.ranks)),
            *self.rank_rows(),
            ("run_queue", s.run_queue()),
            ("waiting_for_memory", sum(p.waiting for p in self.k.procs)),
            ("processes", len(self.k.procs)),
            ("steps", st.steps),
            ("steps_per_s", f"{len(recent) / window:.1f}" if window else "0.0"),
            ("tokens_per_s", f"{sum(tokens) / window:.1f}" if window else "0.0"),
            # The share of the window the engine ran forward passes: below 1 under load, it
            # waited for the loop (finishing and planning steps) or for the LIPs' preds. With
            # --engine sleep:MS the same: a step takes MS there, and its round trip.
            ("engine_busy", f"{sum(r.seconds for r in recent) / window:.2f}"
             if window else "0.00"),
            ("batch_seqs_avg", f"{sum(r.seqs for r in recent) / len(recent):.1f}"
             if recent else "0.0"),
            ("batch_seqs_max", st.max_seqs),
            ("token_budget", s.token_budget),
            ("budget_use", f"{sum(tokens) / len(recent) / s.token_budget:.2f}"
             if recent else "0.00"),
            ("prefill_share", f"{prefill / sum(tokens):.2f}" if sum(tokens) else "0.00"),
            # The event loop thread's CPU time per pred answered, between the window's first
            # and last step: the kernel's own work (transport, checks, scheduling, kvfs,
            # replies), not the engine process's forward passes and sampling.
            ("loop_cpu_us_per_pred", f"{loop_cpu / preds * 1e6:.1f}" if preds else "0.0"),
            ("queue_delay_p50_ms", f"{percentile(delays, 0.5) * 1e3:.2f}"),
            ("queue_delay_p90_ms", f"{percentile(delays, 0.9) * 1e3:.2f}"),
            ("queue_delay_p99_ms", f"{percentile(delays, 0.99) * 1e3:.2f}"),
            ("preemptions", st.preemptions),
            ("pages_swapped_out", st.pages_swapped_out),
            ("admission_waits", st.waits),
            # Decoding ahead (scheduler.py): preds guessed, and how many of them a pred took.
            ("decode_ahead", "on" if s.decode_ahead else "off"),
            ("ahead_guesses", st.ahead),
            ("ahead_used", st.ahead_used),
            # Pipelined steps (scheduler.py): planned while the one before computed.
            ("pipeline", "on" if s.pipeline else "off"),
            ("steps_pipelined", st.pipelined),
        ]
        return lines(pairs)

    def rank_rows(self) -> list[tuple[str, str]]:
        ranks = self.k.engine.ranks
        busy = self.clock.busy([r.pid for r in ranks if r.node == 0], time.monotonic())
        return [(f"rank{r.rank}", f"pid={r.pid} node={r.node} host={r.host} device={r.device} "
                 f"busy={f'{busy[r.pid]:.2f}' if r.node == 0 and r.pid in busy else '-'}")
                for r in ranks]

    def status(self, p: Process, mine: bool) -> str:
        return lines([
            ("pid", p.pid), ("os_pid", p.os_pid), ("name", p.name),
            ("argv", " ".join(p.argv) if mine else ""),
            ("state", p.state), ("uid", p.uid), ("user", p.user), ("gid", p.cred.gid),
            ("nice", p.nice), ("fds", len(p.fds)), ("pages", self.k.pages_of(p)),
            ("tokens", p.tokens), ("syscalls", sum(p.calls.values())),
            ("cpu_seconds", f"{p.cpu_seconds:.2f}"),
            ("accel_seconds", f"{p.accel_seconds:.3f}"),
            ("uptime_s", f"{time.time() - p.started:.1f}"),
        ])

    def fds(self, p: Process) -> str:
        out = ["fd\tino\tmode\ttokens\tpages\n"]
        for fd, h in sorted(p.fds.items()):
            mode = ("r" if h.readable else "-") + ("w" if h.writable else "-")
            pages = sum(page is not None for page in h.inode.pages)
            out.append(f"{fd}\t{h.inode.ino}\t{mode}\t{h.inode.length}\t{pages}\n")
        return "".join(out)

    def syscalls(self, p: Process) -> str:
        out = ["call\tcount\ttotal_ms\tmean_us\n"]
        for name, count in sorted(p.calls.items()):
            total = p.call_seconds[name]
            out.append(f"{name}\t{count}\t{total * 1e3:.2f}\t{total / count * 1e6:.1f}\n")
        return "".join(out)

    def kv(self) -> str:
        """A line per page with more than one reference (meminfo's `shared`), with the files
        (by inode) that hold it: named, or open in a process. An export's snapshot, which
        holds a reference while it streams, is neither: it counts in refs alone."""
        live = self.k.fs.store.live
        shared: dict[Page, set[int]] = {page: set() for page in live if page.refs > 1}
        inodes = {i.ino: i for i in self.k.fs.files()}
        for p in self.k.procs:
            inodes.update({h.inode.ino: h.inode for h in p.fds.values()})
        for ino, inode in inodes.items():
            for page in inode.pages:
                if page in shared:
                    shared[page].add(ino)
        out = ["page\ttier\trefs\tinodes\n"]
        for page, inos in sorted(shared.items(),
                                 key=lambda kv: (sorted(kv[1]), kv[0].tier, kv[0].slot)):
            out.append(f"{page.tier}:{page.slot}\t{page.tier}\t{page.refs}\t"
                       f"{','.join(map(str, sorted(inos)))}\n")
        return "".join(out)

"""Export throughput through the mount (issue 6), as root.

`cp` of a 32k-token KV file out of the mount, against the `export` syscall streamed
straight into a local file, and against `cp` of a local file of the same size (in the page
cache: the bound for any file system). All three write to the same local directory; runs
are interleaved and repeated, best and median printed, with the CPU seconds that all the
processes involved spent (kernel, mount, cp, this one): on a shared machine throughput
moves with the neighbours' load, CPU time much less.

    sudo .venv/bin/python bench/mount.py [--model DIR] [--tokens 32768] [--repeat 7]

The file is built without computing 32k positions: 1024 entries are predicted once
(positions 0..1023, the context of the tiny model, models/tiny, the default --model), then
spliced onto one file again and again (positions i % 1024), sharing the pages. Its bytes
are those of any file that long.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from syscalls.client import Kernel

ROOT = Path(__file__).resolve().parents[1]
SYMPHONY = [sys.executable, "-m", "symphony.cli"]
BLOCK = 1024  # entries predicted once; the file repeats them


def symphony(*args: str) -> None:
    subprocess.run([*SYMPHONY, *args], check=True, cwd=ROOT)


def cp(src: Path, dst: Path) -> None:
    subprocess.run(["cp", str(src), str(dst)], check=True)


def build(k: Kernel, path: str, tokens: int) -> None:
    vocab = k.model_info().vocab_size
    with k.open("", os.O_RDWR) as block, k.open(path, os.O_CREAT | os.O_RDWR) as f:
        block.pred([(7 * i) % (vocab - 3) + 3 for i in range(BLOCK)], no_outputs=True)
        for start in range(0, tokens, BLOCK):
            f.splice_from(block, 0, min(BLOCK, tokens - start))


def cpu_seconds(pids: list[int]) -> float:
    """CPU time so far of `pids`, of this process and of its waited-for children."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def timed(fn: Callable[[], None], pids: list[int]) -> tuple[float, float]:
    """Wall and CPU seconds of fn."""
    cpu, start = cpu_seconds(pids), time.perf_counter()
    fn()
    return time.perf_counter() - start, cpu_seconds(pids) - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "tiny"),
                        help="checkpoint (default: models/tiny, the 5.5M test model "
                        "bench/RESULTS.md's figures were taken on)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/mount.py: the mount needs root", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="symphony-bench-mount-"))
    tmp.chmod(0o755)
    sock, mnt, out, local = tmp / "k.sock", tmp / "mnt", tmp / "out.kv", tmp / "local.kv"
    mnt.mkdir()
    symphony(
        "start",
        "--socket",
        str(sock),
        "--state-dir",
        str(tmp / "state"),
        "--kv-pages",
        "512",
        "--model",
        args.model,
    )
    try:
        with Kernel.connect(sock, name="bench-mount") as k:
            build(k, "/tmp/big.kv", args.tokens)
            size = k.stat("/tmp/big.kv").size

            def direct() -> None:
                with open(out, "wb") as f:
                    for chunk in k.export_iter("/tmp/big.kv"):
                        f.write(chunk)

            direct()
            out.rename(local)
            symphony("mount", str(mnt), "--socket", str(sock))
            try:
                kernel = int(sock.with_name(sock.name + ".pid").read_text())
                pids = [kernel, *(p.os_pid for p in k.ps() if p.name == "mount")]
                runs: dict[str, tuple[Callable[[], None], list[tuple[float, float]]]] = {
                    "export syscall": (direct, []),
                    "cp from the mount": (lambda: cp(mnt / "tmp/big.kv", out), []),
                    "cp on local disk": (lambda: cp(local, out), []),
                }
                for _ in range(args.repeat):
                    for fn, times in runs.values():
                        out.unlink(missing_ok=True)
                        times.append(timed(fn, pids))
                        if out.stat().st_size != size:
                            raise AssertionError(f"{out}: {out.stat().st_size} bytes, not {size}")
                subprocess.run(["cmp", str(out), str(local)], check=True)
            finally:
                symphony("umount", str(mnt))
    finally:
        symphony("stop", "--socket", str(sock))
        shutil.rmtree(tmp)
    mib = size / (1 << 20)
    print(
        f"# {platform.machine()}, {os.cpu_count()} cpus; {args.tokens} tokens, "
        f"{mib:.1f} MiB; best and median of {args.repeat}"
    )
    print(f"{'':<20}{'best MiB/s':>12}{'median MiB/s':>14}{'vs syscall':>12}{'CPU s':>8}")
    base = statistics.median(wall for wall, _ in runs["export syscall"][1])
    for name, (_, times) in runs.items():
        walls = [wall for wall, _ in times]
        median = statistics.median(walls)
        cpu = statistics.median(c for _, c in times)
        print(
            f"{name:<20}{mib / min(walls):>12.0f}{mib / median:>14.0f}"
            f"{base / median:>11.2f}x{cpu:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

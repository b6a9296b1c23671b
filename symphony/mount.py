"""`symphony mount DIR` and `symphony umount DIR`: the kernel's KV files as a file system
(kvfs/fuse.py)."""

from __future__ import annotations

import argparse
import errno
import os
import stat
import subprocess
import sys

from symphony.top import seconds


def fail(message: str) -> int:
    print(f"symphony: {message}", file=sys.stderr)
    return 1


def cmd_mount(args: argparse.Namespace) -> int:
    target = os.path.abspath(args.dir)
    if os.geteuid() != 0:
        return fail("mount: must run as root (it acts for each user, with allow_other)")
    try:
        is_dir = stat.S_ISDIR(os.stat(target).st_mode)
    except OSError as e:
        if e.errno == errno.ENOTCONN:  # a FUSE mount whose process is gone (kill -9)
            return fail(
                f"mount: {target}: a dead mount is there (its mount process is gone): "
                f"run `symphony umount {args.dir}` first"
            )
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            return fail(f"mount: {target}: {e.strerror}")
        is_dir = False
    if not is_dir:
        return fail(f"mount: {target}: not a directory")
    if os.path.ismount(target):
        return fail(f"mount: {target}: already a mount point")
    if args.foreground:
        import logging

        from kvfs.fuse import mount

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        return mount(target, args.socket, wait=args.timeout)
    # The child mounts and says "ok" on the pipe once the mount is live, or why it could
    # not. It forks before any gRPC channel exists: channels do not survive a fork.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os._exit(background(target, args.socket, args.timeout, w))
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        said = pipe.read().decode(errors="replace").strip()
    if said != "ok" or not os.path.ismount(target):
        os.waitpid(pid, 0)
        return fail(f"mount: {said or 'the mount process exited'}")
    return 0


def background(target: str, socket: str | None, wait: float | None, w: int) -> int:
    """The mount process: its own session, quiet once the mount is live."""
    os.setsid()
    live = False

    def ready() -> None:
        nonlocal live
        os.write(w, b"ok\n")
        os.close(w)
        live = True
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)

    try:
        from kvfs.fuse import mount

        return mount(target, socket, ready, wait)
    except Exception as e:
        if not live:
            os.write(w, f"{getattr(e, 'strerror', None) or e}\n".encode())
        return 1


def fusermount(*argv: str) -> subprocess.CompletedProcess:
    # The C locale: its errors are read for "busy".
    return subprocess.run(["fusermount3", *argv], capture_output=True, text=True,
                          env={**os.environ, "LC_ALL": "C"})


def cmd_umount(args: argparse.Namespace) -> int:
    """fusermount3 -u; a busy mount (a file open in it, or a working directory; a dead one
    too) is detached lazily (-z). The mount process exits when its mount goes."""
    done = fusermount("-u", args.dir)
    if done.returncode and "Device or resource busy" in done.stderr:
        done = fusermount("-u", "-z", args.dir)
        if not done.returncode:
            print(f"symphony: umount: {args.dir}: busy (a file open in it, or a working "
                  "directory): detached lazily; it goes once nothing uses it", file=sys.stderr)
    if done.returncode:
        return fail(f"umount: {done.stderr.strip() or 'fusermount3 failed'}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("mount", help="mount the kernel's KV files at DIR (as root)")
    m.add_argument("dir")
    m.add_argument(
        "--socket",
        help="the kernel's socket (default: $SYMPHONY_SOCKET or /tmp/symphony/kernel.sock)",
    )
    m.add_argument(
        "--foreground",
        action="store_true",
        help="serve in this process instead of returning once mounted",
    )
    m.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help="how long a request waits for the kernel before it fails with ETIMEDOUT "
        "(default: kvfs.fuse.KERNEL_WAIT, 60)",
    )
    m.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="unmount a mount made by symphony mount")
    u.add_argument("dir")
    u.set_defaults(func=cmd_umount)

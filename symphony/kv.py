"""`symphony kv`: the kernel's KV files from the shell, through the syscalls.

In `ls`, `cat` and `rm` every path is a kernel path. In `cp` a kernel path is written
`kv:PATH` and any other argument is a local file (`-` is no special name: use /dev/stdin,
or `kv cat` for stdout). A kernel path is absolute, or relative to your home: `kv:doc.kv`
is /home/<user>/doc.kv, and `kv:` alone is the home. A file's bytes are its canonical
serialized form (docs/kv-format.md), the bytes the mount shows.

A kernel path is in the kernel of --socket (default: $SYMPHONY_SOCKET, else
/tmp/symphony/kernel.sock), or names its kernel: `kv:SOCKET:PATH`, where SOCKET is the
socket that kernel listens on (its --socket) and is taken as one when it is a socket file
(`kv:/run/b.sock:doc.kv`). So `kv cp kv:/run/a.sock:doc.kv kv:/run/b.sock:` copies a file
from one kernel to another (both on one model: the other refuses a file of another).
"""

from __future__ import annotations

import argparse
import errno
import os
import posixpath
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path

from syscalls.client import Kernel
from syscalls.convert import CHUNK_BYTES, Stat
from syscalls.flags import each, report
from syscalls.session import socket_path
from syscalls.users import user_name

PREFIX = "kv:"


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def split_kernel(arg: str) -> tuple[str | None, str]:
    """The socket of the kernel that `arg` (with or without the kv: prefix) names (None:
    --socket's), and the path in it: `SOCKET:PATH` when SOCKET is a socket file."""
    rest = arg.removeprefix(PREFIX)
    sock, colon, path = rest.partition(":")
    if colon and sock and is_socket(sock):
        return sock, path
    return None, rest


class Kernels:
    """The sessions `kv` opens: --socket's kernel and any that a path names, each once
    however its socket is spelled (one kernel, one session: cp compares its files)."""

    def __init__(self, default: str | None):
        self.default = default
        self.open: dict[str, Kernel] = {}

    def of(self, arg: str) -> tuple[Kernel, str]:
        """The session of the kernel `arg` names and the absolute path in it."""
        sock, path = split_kernel(arg)
        key = os.path.realpath(socket_path(sock or self.default))
        if key not in self.open:
            self.open[key] = Kernel.connect(sock or self.default, name="symphony-kv")
        k = self.open[key]
        return k, path if path.startswith("/") else f"{k.home}/{path}".rstrip("/")

    def close(self) -> None:
        for k in self.open.values():
            k.close()


def long_lines(entries: list[tuple[str, Stat]]) -> list[str]:
    """ls -l: mode, owner, tokens, pages, size, mtime, name; columns as wide as needed."""
    rows = [
        (
            stat.filemode(s.mode),
            user_name(s.uid),
            str(s.tokens),
            str(s.pages),
            str(s.size),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(s.mtime_ns / 1e9)),
            name,
        )
        for name, s in entries
    ]
    widths = [max((len(row[i]) for row in rows), default=0) for i in range(5)]
    return [
        f"{r[0]} {r[1]:<{widths[1]}} {r[2]:>{widths[2]}} {r[3]:>{widths[3]}} "
        f"{r[4]:>{widths[4]}} {r[5]} {r[6]}"
        for r in rows
    ]


def cmd_ls(kernels: Kernels, args: argparse.Namespace) -> int:
    k, path = kernels.of(args.path)
    st = k.stat(path)
    entries = sorted(k.readdir(path), key=lambda e: e[0]) if st.is_dir else [(args.path, st)]
    for line in long_lines(entries) if args.long else [name for name, _ in entries]:
        print(line)
    return 0


def cmd_cat(kernels: Kernels, args: argparse.Namespace) -> int:
    """As cat(1): a path that cannot be read does not stop the others."""
    out = sys.stdout.buffer

    def cat(arg: str) -> None:
        k, path = kernels.of(arg)
        for chunk in k.export_iter(path):
            out.write(chunk)

    status = each("kv cat", args.paths, cat)
    out.flush()
    return status


def read_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(partial(f.read, CHUNK_BYTES), b"")


@dataclass(frozen=True)
class Source:
    """cp's SRC: its file name, permission bits and bytes in chunks; `file` is a kernel
    file's session, path and inode, None for a local file."""

    name: str
    mode: int
    chunks: Iterator[bytes]
    file: tuple[Kernel, str, int] | None


def source(kernels: Kernels, arg: str) -> Source:
    """cp's SRC. The first chunk is fetched here so that a refusal (ENOENT, EACCES, EISDIR)
    raises as itself, not inside the import stream, where gRPC would report it only as a
    failed request iterator."""
    if arg.startswith(PREFIX):
        k, path = kernels.of(arg)
        st = k.stat(path)
        mode, chunks, file = st.mode, k.export_iter(path), (k, path, st.ino)
    else:
        path = arg
        mode, chunks, file = os.stat(path).st_mode, read_chunks(path), None
    return Source(posixpath.basename(path), stat.S_IMODE(mode),
                  chain([next(chunks, b"")], chunks), file)


def write_local(path: Path, chunks: Iterable[bytes], mode: int) -> None:
    """As cp(1) writes DST, once the whole file has arrived (as import takes it). An
    existing file is written into (through symlinks), so it keeps its inode, owner, mode
    and links, and needs permission to write it: opened first, the bytes are received into
    an unnamed temporary file, then copied in. A new file gets SRC's bits: received into a temporary
    file beside it, renamed to its name once they have all arrived. Into what is not a
    regular file (/dev/null, a FIFO, a terminal) they are written as they come."""
    if not path.exists():
        _write_new(path, chunks, mode)
        return
    regular = path.is_file()
    with os.fdopen(os.open(path, os.O_WRONLY), "wb") as dst:
        if not regular:
            for chunk in chunks:
                dst.write(chunk)
            return
        with tempfile.TemporaryFile() as spool:
            for chunk in chunks:
                spool.write(chunk)
            spool.seek(0)
            dst.truncate(0)
            shutil.copyfileobj(spool, dst, CHUNK_BYTES)


def _write_new(path: Path, chunks: Iterable[bytes], mode: int) -> None:
    path = path.resolve()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError as e:  # it names the temporary file: name the one asked for
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def kernel_stat(k: Kernel, path: str) -> Stat | None:
    """The file's Stat; None when there is none."""
    try:
        return k.stat(path)
    except FileNotFoundError:
        return None


def cmd_cp(kernels: Kernels, args: argparse.Namespace) -> int:
    """Kernel to local exports, local to kernel imports (the kernel checks the file and
    refuses it whole), kernel to kernel does both, within one kernel or between two
    (kv:SOCKET:PATH). A new copy gets SRC's permission bits; an existing DST, kernel or
    local, is rewritten in place, keeping its owner, mode and links, as cp(1) does, and
    either way it is touched only once the whole file has arrived. A DST that is a
    directory receives a file of SRC's name; one ending in / must be a directory. A file is
    not copied onto itself, as cp(1) refuses: the import would rewrite what it reads."""
    if not (args.src.startswith(PREFIX) or args.dst.startswith(PREFIX)):
        raise ValueError(
            f"neither {args.src} nor {args.dst} is a kernel path (write one as {PREFIX}PATH)"
        )
    src = source(kernels, args.src)
    if args.dst.startswith(PREFIX):
        k, dst = kernels.of(args.dst)
        target = kernel_stat(k, dst)
        if target is not None and target.is_dir:
            dst = f"{dst.rstrip('/')}/{src.name}"
            target = kernel_stat(k, dst)
        elif dst.endswith("/"):  # as cp(1): a name ending in / is a directory's or nothing
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), args.dst)
        if src.file is not None and target is not None:
            kernel, path, ino = src.file
            if kernel is k and ino == target.ino:
                raise ValueError(f"'{PREFIX}{path}' and '{PREFIX}{dst}' are the same file")
        k.import_file(dst, src.chunks, src.mode)
    else:
        local = Path(args.dst)
        if not local.is_dir() and args.dst.endswith("/"):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), args.dst)
        write_local(local / src.name if local.is_dir() else local, src.chunks, src.mode)
    return 0


def cmd_rm(kernels: Kernels, args: argparse.Namespace) -> int:
    """As rm(1): one path that cannot be removed does not stop the others."""

    def rm(arg: str) -> None:
        k, path = kernels.of(arg)
        k.unlink(path)

    return each("kv rm", args.paths, rm)


def run(args: argparse.Namespace) -> int:
    """The operation's status; a failure is said as `symphony: kv OP: ...`, as cat's and
    rm's of each path are (each)."""
    kernels = Kernels(args.socket)
    try:
        return args.kv_command(kernels, args)
    except (OSError, ValueError) as e:
        return report(f"symphony: kv {args.kv_op}", e)
    finally:
        kernels.close()


def add_parser(sub: argparse._SubParsersAction) -> None:
    kv = sub.add_parser(
        "kv",
        help="list, print, copy and remove KV files through the kernel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kv.set_defaults(func=run)
    # --socket goes on each command, not on `kv`: a subparser's default would override it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", help="the kernel's socket (default: $SYMPHONY_SOCKET or "
                        "/tmp/symphony/kernel.sock)")
    ops = kv.add_subparsers(dest="kv_op", required=True)
    ls = ops.add_parser("ls", parents=[common], help="list a directory (default: your home)")
    ls.add_argument(
        "-l", dest="long", action="store_true",
        help="mode, owner, tokens, pages, size (bytes of the canonical form), mtime (local "
        "time), name",
    )
    ls.add_argument("path", nargs="?", default="")
    ls.set_defaults(kv_command=cmd_ls)
    cat = ops.add_parser("cat", parents=[common], help="write files' serialized bytes to stdout")
    cat.add_argument("paths", nargs="+")
    cat.set_defaults(kv_command=cmd_cat)
    cp = ops.add_parser(
        "cp",
        parents=[common],
        help="copy between kv:PATH (or kv:SOCKET:PATH) and local files",
        description=cmd_cp.__doc__,
    )
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(kv_command=cmd_cp)
    rm = ops.add_parser("rm", parents=[common], help="remove files")
    rm.add_argument("paths", nargs="+")
    rm.set_defaults(kv_command=cmd_rm)
    ops.metavar = "{" + ",".join(ops.choices) + "}"  # "required: kv_op" named none of them

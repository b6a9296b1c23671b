"""The namespace's journal, STATE/namespace.log: the changes made since namespace.json was
written, a line each, so that a call that changes a name costs a line on disk, not the
whole namespace.

The first line is {"generation": G}: the journal belongs to the namespace.json of that
generation and is ignored next to any other (a crash after a new namespace.json was
written and before its journal was started leaves the old journal, whose changes the new
namespace.json holds already). Each further line is {"ops": [...], "next_ino": N},
written and fdatasynced before the call that made the change answers. A crash mid-line
leaves a last line without its newline: its call never answered, and it is ignored. The
ops, applied in order to namespace.json's record:

    ["set", INO, META]          INO is newly named outside /tmp (a directory's META has
                                its entries)
    ["attr", INO, ATTRS]        INO's attributes (META but a directory's entries)
    ["root", ATTRS]             the root's
    ["link", DIR, NAME, INO]    DIR's NAME names INO (over whatever it named)
    ["unlink", DIR, NAME]       DIR's NAME is gone
    ["drop", INO]               INO has no name outside /tmp any more
"""

from __future__ import annotations

import json
import os
from pathlib import Path

JOURNAL = "namespace.log"


def header(generation: int) -> bytes:
    return json.dumps({"generation": generation}).encode() + b"\n"


def append(path: Path, ops: list, next_ino: int) -> None:
    """One change, on disk when this returns."""
    line = json.dumps({"ops": ops, "next_ino": next_ino}, separators=(",", ":")).encode()
    data = memoryview(line + b"\n")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # made by the namespace's save, 0600
    try:
        while data:
            data = data[os.write(fd, data):]
        os.fdatasync(fd)
    finally:
        os.close(fd)


def replay(record: dict, text: bytes, root: int) -> int | None:
    """Apply a journal's changes to `record` (namespace.json's, root's inode number `root`):
    how many lines it had, None if it is not the record's (another generation). ValueError
    for a journal that is not one."""
    lines = text.split(b"\n")[:-1]  # what follows the last newline is a torn line, or b""
    if not lines:
        return None
    if json.loads(lines[0]) != {"generation": record.get("generation", 0)}:
        return None
    inodes = record["inodes"]

    def entries(ino: int) -> dict:
        return record["root"]["entries"] if ino == root else inodes[str(ino)]["entries"]

    try:
        for line in lines[1:]:
            change = json.loads(line)
            for op, *args in change["ops"]:
                if op == "set":
                    inodes[str(args[0])] = args[1]
                elif op == "attr":
                    inodes[str(args[0])].update(args[1])
                elif op == "root":
                    record["root"].update(args[0])
                elif op == "link":
                    entries(args[0])[args[1]] = args[2]
                elif op == "unlink":
                    entries(args[0]).pop(args[1], None)
                elif op == "drop":
                    inodes.pop(str(args[0]), None)
                else:
                    raise ValueError(f"no such change {op!r}")
            record["next_ino"] = max(record["next_ino"], change["next_ino"])
    except (KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"{JOURNAL}: a change names what is not there ({e!r})") from e
    return len(lines) - 1

"""User names as the kernel gives them (for /home/<user>, ps, ls, /proc/meminfo): light, imports
no torch; in the library, for the mount and `symphony kv` to name users as the kernel does."""

from __future__ import annotations

import pwd


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"

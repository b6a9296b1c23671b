"""User names as the kernel gives them (for /home/<user>, ps, ls): light, imports no torch."""

from __future__ import annotations

import pwd


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"

"""The kernel opens its sockets to every user (mode 0666) through the node it bound, never
through a symlink or another file put at the path (daemon.share_socket)."""
from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import pytest

from symphony.daemon import share_socket


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_bound_socket_becomes_0666(tmp_path):
    path = tmp_path / "k.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        os.chmod(path, 0o600)
        share_socket(path)
        assert mode(path) == 0o666


def test_a_symlink_at_the_path_is_refused_and_its_target_unchanged(tmp_path):
    target = tmp_path / "shadow"
    target.write_text("secret\n")
    target.chmod(0o600)
    path = tmp_path / "k.sock"
    path.symlink_to(target)  # put there between the kernel's bind and its chmod
    with pytest.raises(OSError, match=str(path)) as e:
        share_socket(path)
    assert e.value.errno == errno.ELOOP
    assert mode(target) == 0o600
    assert path.is_symlink()


def test_a_regular_file_at_the_path_is_refused_and_unchanged(tmp_path):
    path = tmp_path / "k.sock"
    path.write_text("")
    path.chmod(0o600)
    with pytest.raises(OSError, match=str(path)) as e:
        share_socket(path)
    assert e.value.errno == errno.ENOTSOCK
    assert mode(path) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_another_users_socket_at_the_path_is_refused_and_unchanged(tmp_path):
    path = tmp_path / "k.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        os.chmod(path, 0o600)
        os.chown(path, os.geteuid() + 1, -1)
        with pytest.raises(OSError, match=str(path)) as e:
            share_socket(path)
        assert e.value.errno == errno.EPERM
        assert mode(path) == 0o600

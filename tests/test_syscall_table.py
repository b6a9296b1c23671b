"""The syscall table (symphony/syscall_table.py) serves the proto's Kernel service
(syscalls/symphony.proto): each rpc of it and no other, with its request and reply messages
and its streaming, as the server registers them (symphony/server.py, Front.handler); and
what a call of it does on a real kernel where the table's function decides it."""

from __future__ import annotations

import inspect
import os

import pytest

from symphony.syscall_table import TABLE
from syscalls import symphony_pb2 as pb
from syscalls.users import user_name

SERVICE = pb.DESCRIPTOR.services_by_name["Kernel"]


def from_proto() -> dict[str, tuple[str | None, str, bool]]:
    """Each rpc as a row of TABLE says it: request message (None for a client stream),
    reply message, whether the server streams."""
    return {m.name: (None if m.client_streaming else m.input_type.full_name,
                     m.output_type.full_name, m.server_streaming)
            for m in SERVICE.methods}


def from_table(table: dict) -> dict[str, tuple[str | None, str, bool]]:
    return {name: (None if request is None else request.DESCRIPTOR.full_name,
                   reply.DESCRIPTOR.full_name, streams)
            for name, (_, request, reply, streams) in table.items()}


def test_the_table_has_every_rpc_of_the_proto_with_its_messages_and_streaming():
    assert len(SERVICE.methods) > 30
    assert from_table(TABLE) == from_proto()


def test_a_client_stream_is_of_the_message_the_server_parses_it_as():
    # TABLE has no request message for a client stream (Import): the server parses every
    # one as an ImportChunk, so that is what the proto must send.
    streams = {m.name: m.input_type.full_name for m in SERVICE.methods if m.client_streaming}
    assert streams == {"Import": pb.ImportChunk.DESCRIPTOR.full_name}


def test_each_function_is_of_the_kind_its_streaming_asks():
    # The server iterates a server stream's function (async for) and awaits a client
    # stream's; a unary one may be either plain or a coroutine.
    for name, (fn, request, _, streams) in TABLE.items():
        assert inspect.isasyncgenfunction(fn) == streams, name
        if request is None:
            assert inspect.iscoroutinefunction(fn), name


def test_the_check_sees_a_wrong_row():
    good = from_proto()
    for name, row in [("Export", (TABLE["Export"][0], pb.ExportRequest, pb.ExportChunk, False)),
                      ("Stat", (TABLE["Stat"][0], pb.PathRequest, pb.StatReply, False)),
                      ("Import", (TABLE["Import"][0], pb.ImportChunk, pb.Empty, False)),
                      ("Read", (TABLE["Read"][0], pb.ReadRequest, pb.Empty, False))]:
        assert from_table({**TABLE, name: row}) != good, name
    assert from_table({k: v for k, v in TABLE.items() if k != "Procfs"}) != good
    extra = {**TABLE, "Nap": (TABLE["GetPid"][0], pb.Void, pb.Empty, False)}
    assert from_table(extra) != good


def test_attach_acting_as_a_user_reports_that_user_and_makes_its_home(k):
    """With symphony-as, attach said the root session's uid 0 and /home/root, while open
    with the same header made files as the user."""
    if os.geteuid() != 0:
        pytest.skip("only a root session may act as another user")
    uid, gid = 4242, 4343
    user = user_name(uid)
    view = k.acting_as(uid, gid)
    view.attach("acting")
    assert (view.pid, view.uid, view.gid, view.user, view.home) == (
        k.pid, uid, gid, user, f"/home/{user}")
    home = k.stat(view.home)
    assert (home.uid, home.gid, home.is_dir) == (uid, gid, True)
    with view.open(f"{view.home}/made.kv", os.O_CREAT | os.O_RDWR):
        made = k.stat(f"{view.home}/made.kv")
    assert (made.uid, made.gid) == (uid, gid)  # as attach said
    assert next(p.name for p in k.ps() if p.pid == k.pid) == "acting"  # the session's process
    k.attach()
    assert (k.uid, k.gid, k.home) == (0, 0, "/home/root")  # the session's own, without it

"""The engine's ranks: with `--tensor-parallel N`, N engine processes in one torch.distributed
group, each with its shard of the weights (symphony.engine.tensor_parallel) and of the KV
pool (kvfs.pool).

Who starts them. The kernel lives on node 0 and starts node 0's ranks as its children; rank
0 is the engine process of engine_process.py, which talks to the kernel. On every other
node `symphony rank` starts that node's ranks (`python -m symphony.ranks`). All of them meet
at node 0's address (--master-addr, --master-port), rank r on node r // (N / nnodes): rank
0 serves a TCP store there (bound to --master-addr's interface only), each other rank puts
its Claim in it under its rank (rank count, node count, device kind, and off node 0 its
checkpoint's fingerprint), as JSON parsed strictly, never unpickled, and rank 0 refuses one
that differs from its own (meet) before they form the torch.distributed group over the
store. A node's ranks are claimed as a whole: the first claim of a node's ranks makes the
node its claimant's (the kernel's on node 0, a `symphony rank` process elsewhere), and every
rank of another claimant of that node (a duplicate --node-rank, a node restarted after it
claimed, a node started after the group formed) is refused at once; the first keeps its
place.

Trust. Before the group forms, nothing read from the store is unpickled. Once it forms, the
ranks exchange pickled Python objects over the group (torch.distributed's object
collectives: RankSetup, RankInfo, each step's batch), and the group's own wiring goes through
the store: as with torch.distributed itself, whoever can reach the master port, or the
ranks' gloo ports, can run code as the kernel. Those ports must be reachable from the
trusted nodes only.
The backend is NCCL on GPUs (one a rank: cuda:LOCAL_RANK), gloo on the CPU; Python objects
go over a gloo group either way.

What flows. Rank 0 builds its engine from the kernel's settings and broadcasts them
(`RankSetup`); the others build theirs, and rank 0 gathers what each is (`RankInfo`) or the
error that stopped it. Then, each step, rank 0 broadcasts the step's batch; every rank runs
the forward pass, whose all-reduces and LM-head gather join them; rank 0 samples and
answers. A broadcast of None stops them.

The KV pool's shards. A rank on node 0 computes in its shard of the kernel's pool, mapped
from the kernel's memory (a memfd on the CPU, CUDA IPC on a GPU). A rank on another node
cannot map it: it holds its shard itself, and the kernel keeps a mirror of it that rank 0
maps. The two are kept equal around each step: before it, rank 0 sends the rank the pages
the kernel changed since the last step (kvfs's copies, moves up, imports, shifts); after
it, the rank sends back the K/V rows the step wrote. So kvfs sees one pool on every node.

Life and death. Node 0's ranks die with the kernel (PR_SET_PDEATHSIG), and the kernel stops
when any of them exits. A collective that fails (a rank gone, on any node) ends the rank
that saw it: so a dead rank anywhere ends rank 0, and with it the kernel; and ranks on other
nodes end when the group breaks, the kernel's death included.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kvfs.pool import DEVICE, KVPool, PageShape, pool_shard_shape
from symphony.engine.config import ModelConfig
from symphony.engine.engine import Batch, Engine
from symphony.engine.errors import ModelError
from symphony.engine.settings import require_cuda
from symphony.engine.tensor_parallel import Group, shard_of
from symphony.options import RENDEZVOUS_SECONDS

# How long a rank waits for the others to join, and for a collective: a rank that died
# mid-collective is seen at once (its sockets close); this bounds a rank that hangs.
TIMEOUT = timedelta(seconds=RENDEZVOUS_SECONDS)
DEFAULT_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the N ranks meet: N/nnodes ranks on each of `nnodes` nodes."""

    world: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port of node 0's, picked by the kernel (one node)

    def __post_init__(self):
        if self.world < 1 or self.nnodes < 1 or self.world % self.nnodes:
            raise ValueError(
                f"--tensor-parallel {self.world} ranks over --nnodes "
                f"{self.nnodes}: want a multiple of the node count"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} outside [0, {self.nnodes})")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port}: not a TCP port (1 to 65535)")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError(
                "--nnodes above 1 needs --master-port (and --master-addr, node 0's address)"
            )

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    def local_ranks(self) -> range:
        """This node's ranks."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def with_port(self) -> Rendezvous:
        """This one, with a free port picked when none was given."""
        if self.master_port:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            port = s.getsockname()[1]
        return Rendezvous(self.world, self.nnodes, self.node_rank, self.master_addr, port)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def from_environment(
    world: int,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
) -> Rendezvous:
    """A Rendezvous from the flags given, else torchrun's environment variables (NNODES,
    NODE_RANK or GROUP_RANK, MASTER_ADDR, MASTER_PORT), else one node."""
    env = os.environ
    nnodes = nnodes or int(env.get("NNODES", 1))
    return Rendezvous(
        world,
        nnodes,
        node_rank if node_rank is not None else int(env.get("NODE_RANK", env.get("GROUP_RANK", 0))),
        master_addr or env.get("MASTER_ADDR", "127.0.0.1"),
        master_port or int(env.get("MASTER_PORT", DEFAULT_PORT if nnodes > 1 else 0)),
    )


@dataclass(frozen=True)
class RankSetup:
    """What rank 0 tells the others to build: its engine's settings (each rank reads the
    checkpoint at its own path: on node 0 the kernel's, elsewhere `symphony rank --model`)."""

    dtype: torch.dtype
    pages: int
    page_size: int
    weights: str
    remote: tuple[int, ...]  # ranks off node 0: their shards are mirrored in the kernel


@dataclass(frozen=True)
class RankInfo:
    """What a rank is, for /proc/sched: `busy` is read from node 0's /proc where `node` is 0."""

    rank: int
    pid: int
    host: str
    node: int
    device: str


def rank_device(kind: str, rdv: Rendezvous, rank: int) -> torch.device:
    """A rank's device: its own GPU of its node's (cuda:LOCAL_RANK), or the CPU."""
    if kind == "cuda":
        require_cuda()
        return torch.device("cuda", rank - rdv.node_rank * rdv.per_node)
    return torch.device("cpu")


@dataclass(frozen=True)
class Claim:
    """What a rank says it is when it comes to the rendezvous: rank 0 refuses one that does
    not agree with its own (`disagreement`), before any rank loads its weights. The
    engine's other settings (dtype, weights, page size, KV pages) are rank 0's alone: it
    hands them to the others (RankSetup)."""

    rank: int
    world: int
    nnodes: int
    host: str
    device: str  # cpu (gloo) or cuda (NCCL)
    model: str  # the checkpoint's path on the rank's node
    fingerprint: str | None  # the checkpoint's, off node 0 (node 0's ranks read the kernel's)
    # Its node's identity, with `host` (meet's `node/n`): the pid of the process that started
    # the node's ranks (the kernel on node 0, `symphony rank` elsewhere) and, off node 0, that
    # process's random token (a host name and pid alone may be another container's).
    parent: int = field(default_factory=os.getppid)
    token: str | None = None


def claim(rank: int, rdv: Rendezvous, device: torch.device, model: Path,
          fingerprint: str | None, token: str | None = None) -> Claim:
    return Claim(rank, rdv.world, rdv.nnodes, socket.gethostname(), device.type, str(model),
                 fingerprint, token=token)


CLAIM_BYTES = 16384  # a claim's JSON at most
_TEXT = {"host": 255, "device": 8, "model": 4096}
MAX_RANKS = 1 << 16


def encode(c: Claim) -> bytes:
    """A claim as the store holds it: JSON, never a pickle (see decode)."""
    return json.dumps({"rank": c.rank, "world": c.world, "nnodes": c.nnodes, "host": c.host,
                       "device": c.device, "model": c.model, "fingerprint": c.fingerprint,
                       "parent": c.parent, "token": c.token}).encode()


def _node_owner(c: Claim) -> bytes:
    """What a node's key holds once the claimant of `c` claims the node (meet)."""
    return json.dumps({"host": c.host, "parent": c.parent, "token": c.token}).encode()


def _owner_named(raw: bytes) -> str:
    """The owner in a node's key, for the refused claimant to name: 'pid P on host H'."""
    try:
        d = json.loads(raw.decode("utf-8")) if len(raw) <= CLAIM_BYTES else None
    except (UnicodeDecodeError, ValueError):
        d = None
    if isinstance(d, dict) and type(d.get("parent")) is int and type(d.get("host")) is str:
        return f"pid {d['parent']} on host {d['host'][:255]}"
    return f"a claimant that is not one ({bytes(raw[:32])!r})"


def decode(raw: bytes, slot: int) -> Claim:
    """The claim in rank `slot`'s key of the store, parsed strictly: JSON with exactly the
    known keys, each of its type and in its range, naming rank `slot`; else ValueError in
    one line, 'claim for rank N is not a claim: ...'. Anyone who reaches the store can write
    there: nothing is unpickled."""
    def bad(why: str) -> ValueError:
        return ValueError(f"claim for rank {slot} is not a claim: {why}")

    if len(raw) > CLAIM_BYTES:
        raise bad(f"{len(raw)} bytes, at most {CLAIM_BYTES}")
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"not JSON ({_first_line(e)}): {bytes(raw[:32])!r}") from None
    if not isinstance(d, dict):
        raise bad(f"a JSON {type(d).__name__}, not an object")
    keys = {f.name for f in fields(Claim)}
    if set(d) != keys:
        raise bad(f"keys {sorted(d)[:10]}, want {sorted(keys)}")
    for key in ("rank", "world", "nnodes", "parent"):
        if type(d[key]) is not int:
            raise bad(f"{key} {str(d[key])[:32]!r} is not an integer")
    if not 1 <= d["nnodes"] <= d["world"] <= MAX_RANKS or d["world"] % d["nnodes"]:
        raise bad(f"world {d['world']} over nnodes {d['nnodes']}")
    if not 0 <= d["rank"] < d["world"]:
        raise bad(f"rank {d['rank']} outside [0, {d['world']})")
    if d["rank"] != slot:
        raise bad(f"it names rank {d['rank']}")
    if not 0 < d["parent"] < 1 << 31:
        raise bad(f"parent {d['parent']} is not a pid")
    for key, most in _TEXT.items():
        if type(d[key]) is not str or len(d[key]) > most:
            raise bad(f"{key} is not a string of at most {most} characters")
    if d["device"] not in ("cpu", "cuda"):
        raise bad(f"device {d['device']!r}, not cpu or cuda")
    fp = d["fingerprint"]
    if fp is not None and (type(fp) is not str or not 0 < len(fp) <= 128
                           or any(ch not in "0123456789abcdef" for ch in fp)):
        raise bad("fingerprint is neither null nor a hex digest")
    token = d["token"]
    if token is not None and (type(token) is not str or not 0 < len(token) <= 64
                              or any(ch not in "0123456789abcdef" for ch in token)):
        raise bad("token is neither null nor hex")
    return Claim(**d)


def _verdict(problem: str | None) -> bytes:
    return json.dumps({"refused": problem}).encode()


def _read_verdict(raw: bytes) -> str | None:
    """Rank 0's verdict on a claim: None (taken) or why it is refused; a ValueError for
    anything else."""
    try:
        d = json.loads(raw.decode("utf-8")) if len(raw) <= CLAIM_BYTES else None
    except (UnicodeDecodeError, ValueError):
        d = None
    if not (isinstance(d, dict) and set(d) == {"refused"}
            and (d["refused"] is None or type(d["refused"]) is str)):
        raise ValueError(f"the kernel's verdict is not one: {bytes(raw[:32])!r}")
    return d["refused"] and d["refused"].splitlines()[0]


def disagreement(ours: Claim, theirs: Claim) -> str | None:
    """Why rank 0 (`ours`) refuses a rank's claim: None if it does not. (A rank of a second
    claimant of a node never gets here: `node/<node>` refuses it first.)"""
    who = f"rank {theirs.rank} (node {theirs.rank // (theirs.world // theirs.nnodes)}, " \
          f"host {theirs.host})"
    for flag, mine, its in (("--tensor-parallel", ours.world, theirs.world),
                            ("--nnodes", ours.nnodes, theirs.nnodes),
                            ("--device", ours.device, theirs.device)):
        if mine != its:
            return f"{who} has {flag} {its}, the kernel {flag} {mine}"
    if theirs.fingerprint is not None and theirs.fingerprint != ours.fingerprint:
        return (f"{who} has another checkpoint than the kernel: {theirs.model} (fingerprint "
                f"{theirs.fingerprint[:16]}) there, {ours.model} (fingerprint "
                f"{ours.fingerprint[:16]}) on node 0")
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _reach(rdv: Rendezvous, rank: int) -> None:
    """Wait until node 0's rendezvous port takes connections (rank 0 listens there): a
    ModelError after TIMEOUT, in one line (torch's own client would log a C++ trace at each
    try)."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while True:
        try:
            socket.create_connection((rdv.master_addr, rdv.master_port), timeout=5.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ModelError(f"rank {rank}: no kernel at {rdv.master_addr}:"
                                 f"{rdv.master_port} after {TIMEOUT.total_seconds():.0f} s "
                                 f"({e.strerror or e})") from None
            time.sleep(1.0)


def bound(rdv: Rendezvous) -> socket.socket:
    """A socket bound to --master-addr:--master-port, for rank 0's store to listen on that
    address's interface alone (torch's TCPStore would listen on all of them); ModelError
    naming the address where this machine cannot listen (not its address, a port another
    socket listens on, no such host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            rdv.master_addr, rdv.master_port, type=socket.SOCK_STREAM)[0]
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
        except BaseException:
            s.close()
            raise
    except OSError as e:
        raise ModelError(f"rank 0: cannot listen at {rdv.master_addr}:{rdv.master_port} "
                         f"({_first_line(e)})") from None
    return s


class Bystander(ModelError):
    """What a rank of node 0's hears when rank 0 refused another node's rank: rank 0 says
    why, in the kernel's log, and this rank ends without a word (run_follower)."""


def meet(rdv: Rendezvous, mine: Claim) -> dist.TCPStore:
    """The rendezvous's store (rank 0 serves it at --master-port), once each of the N ranks
    has come and rank 0 has found that its claim agrees with rank 0's; else ModelError, on
    rank 0 and on the rank it refused alike, in one line naming what differs (Bystander on
    node 0's other ranks).

    In the store, all JSON (encode, decode): rank 0's own claim at `kernel`; node n's owner
    at `node/n` (_node_owner: host, parent pid, token), set by the first claim of any of the
    node's ranks (n as the kernel counts nodes; rank 0 sets node 0's), so that every rank of
    another claimant of the node is refused at once and the first keeps its place; rank r's
    claim at `claim/r`, put there by the node's owner alone; rank 0's verdict on it at
    `verdict/r`. A rank outside the kernel's range puts its claim at `stray`, for rank 0 to
    name."""
    where, wait = f"{rdv.master_addr}:{rdv.master_port}", TIMEOUT.total_seconds()
    if mine.rank != 0:
        _reach(rdv, mine.rank)
        refused = f"rank {mine.rank}: refused by the kernel at {where}"
        try:
            store = dist.TCPStore(rdv.master_addr, rdv.master_port, is_master=False,
                                  timeout=TIMEOUT, wait_for_workers=False)
            try:
                kernel = decode(store.get("kernel"), 0)
            except ValueError as e:
                raise ModelError(f"rank {mine.rank}: no kernel's rendezvous at {where}: "
                                 f"{e}") from None
            if not 0 < mine.rank < kernel.world:
                store.set("stray", encode(mine))
                problem = disagreement(kernel, mine) or (
                    f"rank {mine.rank} is outside the kernel's ranks 0 to {kernel.world - 1}")
                raise ModelError(f"{refused}: {problem}")
            node = mine.rank // (kernel.world // kernel.nnodes)
            owner = store.compare_set(f"node/{node}", b"", _node_owner(mine))
            if owner != _node_owner(mine):
                raise ModelError(
                    f"{refused}: node {node} was claimed already, by {_owner_named(owner)} "
                    f"(another node with --node-rank {node}, this node before a restart, or "
                    "a group formed already); the first claimant keeps its place")
            store.set(f"claim/{mine.rank}", encode(mine))
            raw = store.get(f"verdict/{mine.rank}")
            if raw != _verdict(None):  # heard, for rank 0 that waits to exit (not to go on)
                store.add("heard", 1)
        except dist.DistError as e:
            raise ModelError(f"rank {mine.rank}: the kernel's rank 0 at {where} went away "
                             f"before every rank came ({_first_line(e)})") from None
        try:
            problem = _read_verdict(raw)
        except ValueError as e:
            raise ModelError(f"{refused}: {e}") from None
        if problem and node == 0:  # another's: node 0's ranks are the kernel's own
            raise Bystander(f"rank {mine.rank}: rank 0 refused another node's rank")
        if problem:
            raise ModelError(f"{refused}: {problem}")
        return store
    listening = bound(rdv)
    try:
        listening.listen(128)
        store = dist.TCPStore(rdv.master_addr, rdv.master_port, is_master=True,
                              timeout=TIMEOUT, wait_for_workers=False,
                              master_listen_fd=listening.detach())
    except (OSError, dist.DistError) as e:
        listening.close()  # unless the store took it
        raise ModelError(f"rank 0: cannot listen at {where} ({_first_line(e)})") from None
    store.set("node/0", _node_owner(mine))  # before `kernel`, which the others wait for
    store.set("kernel", encode(mine))
    came: dict[int, Claim] = {}
    missing = list(range(1, rdv.world))
    deadline = time.monotonic() + wait
    while missing:
        problem = None
        for r in list(missing):
            if store.check([f"claim/{r}"]):
                try:
                    theirs = decode(store.get(f"claim/{r}"), r)
                except ValueError as e:
                    problem = str(e)
                else:
                    problem = disagreement(mine, theirs)
                    came[r] = theirs
                missing.remove(r)
                if problem:
                    break
        if not problem and store.check(["stray"]):
            raw = store.get("stray")
            try:
                stray = decode(raw, json.loads(raw).get("rank"))
            except (ValueError, AttributeError, TypeError) as e:
                problem = f"a claim outside the kernel's ranks is not a claim ({e})"
            else:
                problem = disagreement(mine, stray) or (
                    f"rank {stray.rank} is outside the kernel's ranks 0 to {rdv.world - 1}")
        if problem:
            # Told before this process, and the store with it, goes: each rank that came.
            for r in range(1, rdv.world):
                store.set(f"verdict/{r}", _verdict(problem))
            told = len(came)  # the ranks whose claims were claims (junk hears nothing)
            deadline = time.monotonic() + 5.0
            while store.add("heard", 0) < told and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ModelError(f"rank 0: {problem}")
        if not missing:
            break
        if time.monotonic() > deadline:  # a node that never came, a wrong port: one line
            raise ModelError(f"rank 0: the {rdv.world} ranks did not all meet at "
                             f"{rdv.init_method} (waiting {wait:.0f} s at most): "
                             f"{rdv.world - len(missing)} came, not rank "
                             f"{', '.join(map(str, missing))}")
        time.sleep(0.05)
    for r in range(1, rdv.world):
        store.set(f"verdict/{r}", _verdict(None))
    return store


def join(rdv: Rendezvous, mine: Claim, device: torch.device) -> dist.ProcessGroup | None:
    """Join the group, once all N have come and agree (meet): the gloo group for objects
    where the default one is NCCL (None: the default one is gloo)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the node's cores shared out: threads of ranks that outnumber them stall
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rdv.per_node))
    store = meet(rdv, mine)
    try:
        dist.init_process_group(backend, store=store, rank=mine.rank, world_size=rdv.world,
                                timeout=TIMEOUT)
    except dist.DistError as e:  # a rank that died after it came: said in one line
        raise ModelError(f"rank {mine.rank}: the {rdv.world} ranks did not all meet at "
                         f"{rdv.init_method} (waiting {TIMEOUT.total_seconds():.0f} s at "
                         f"most): {_first_line(e)}") from e
    return dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else None


def info(rank: int, rdv: Rendezvous, device: torch.device) -> RankInfo:
    return RankInfo(rank, os.getpid(), socket.gethostname(), rdv.node_of(rank), str(device))


def gather_infos(cpu_group: dist.ProcessGroup | None, mine: RankInfo | BaseException
                 ) -> list | None:
    """Every rank's RankInfo, or the exception that stopped it, on rank 0 (None elsewhere);
    ModelError on rank 0 for the first rank that did not start, naming it."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0, group=cpu_group)
    for rank, got in enumerate(out or ()):
        if isinstance(got, BaseException):
            raise ModelError(f"rank {rank}: {got}") from got
    return out


class Mirror:
    """Keeps the shards of ranks off node 0 equal to their mirrors in the kernel's pool (see
    the module's docstring), from both ends: rank 0 with `mirrors` (rank -> the kernel's K
    and V of it), a remote rank with its own shard."""

    def __init__(
        self,
        group: Group,
        remote: tuple[int, ...],
        mirrors: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        own: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        self.group, self.remote, self.mirrors, self.own = group, remote, mirrors, own

    def _p2p(self, tensor: torch.Tensor, peer: int, send: bool) -> None:
        (dist.send if send else dist.recv)(tensor, peer, group=self.group.cpu_group)

    def before(self, pages: list[int]) -> None:
        """The pages the kernel changed, to the remote shards."""
        if not pages:
            return
        index = torch.tensor(pages)
        if self.mirrors is not None:
            for r in self.remote:
                k, v = self.mirrors[r]
                self._p2p(torch.stack([k[:, index], v[:, index]]), r, send=True)
        elif self.group.rank in self.remote:
            k, v = self.own
            buf = torch.empty((2, k.shape[0], len(pages), *k.shape[2:]), dtype=k.dtype)
            self._p2p(buf, 0, send=False)
            k[:, index.to(k.device)] = buf[0].to(k.device)
            v[:, index.to(v.device)] = buf[1].to(v.device)

    def after(self, slots: torch.Tensor) -> None:
        """The rows the step wrote, from the remote shards to their mirrors."""
        slots = slots.cpu()
        if self.mirrors is not None:
            for r in self.remote:
                k, v = self.mirrors[r]
                rows_k, rows_v = _rows(k), _rows(v)
                buf = torch.empty((2, k.shape[0], len(slots), *k.shape[3:]), dtype=k.dtype)
                self._p2p(buf, r, send=False)
                rows_k[:, slots], rows_v[:, slots] = buf[0], buf[1]
        elif self.group.rank in self.remote:
            k, v = self.own
            at = slots.to(k.device)
            self._p2p(torch.stack([_rows(k)[:, at], _rows(v)[:, at]]).cpu(), 0, send=True)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[layers, pages, page_size, heads, dim] as [layers, pages * page_size, heads, dim]."""
    return cache.view(cache.shape[0], -1, *cache.shape[3:])


def run_step(engine: Engine, mirror: Mirror | None, batch: Batch, dirty: list[int]):
    """One step's forward pass on any rank, its shard's mirror kept: rank 0's logits."""
    if mirror is None:
        return engine.forward(batch)
    mirror.before(dirty)
    engine.check(batch)  # a bad batch fails on every rank alike, before any collective
    logits = engine.forward(batch)
    mirror.after(engine.metadata(batch).slot_mapping)
    return logits


def follow(group: Group, engine: Engine, mirror: Mirror | None) -> None:
    """A follower's life: run each step rank 0 broadcasts, until it broadcasts None."""
    while True:
        message = group.broadcast(None)
        if message is None:
            return
        batch, dirty = message
        try:
            run_step(engine, mirror, batch, dirty)
        except ValueError:  # the batch's, raised on rank 0 too, which reports it
            continue


def build_follower(
    rank: int,
    rdv: Rendezvous,
    cpu_group: dist.ProcessGroup | None,
    device: torch.device,
    model_dir: Path,
    arrays: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[Group, Engine, Mirror | None]:
    """A follower's engine, from rank 0's setup and its own checkpoint: over `arrays` (its
    shard of the kernel's pool, on node 0) or over a shard of its own (elsewhere), mirrored
    if so. What stops it is told to rank 0 before it is raised here."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=cpu_group)
    setup: RankSetup = box[0]
    try:
        cfg = ModelConfig.from_file(model_dir / "config.json")
        group = Group(shard_of(cfg, rank, rdv.world), cpu_group)
        whole = PageShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, setup.page_size,
                          setup.dtype)
        if arrays is None:
            size = pool_shard_shape(whole, setup.pages, rdv.world, rank)
            arrays = (torch.zeros(size, dtype=setup.dtype, device=device),
                      torch.zeros(size, dtype=setup.dtype, device=device))
        pool = KVPool(replace(whole, kv_heads=group.shard.num_kv_heads), setup.pages, 0,
                      device, arrays=[arrays])
        engine = Engine(model_dir, device=str(device), dtype=setup.dtype, pool=pool,
                        weights=setup.weights, group=group)
    except BaseException as e:
        gather_infos(cpu_group, e)
        raise
    gather_infos(cpu_group, info(rank, rdv, device))
    return group, engine, Mirror(group, setup.remote, own=arrays) if setup.remote else None


class Leader:
    """Rank 0's engine as step.forward sees it: each forward pass broadcast to the others
    first, with the pages the kernel changed (`dirty`, set before each step)."""

    def __init__(self, engine: Engine, group: Group, mirror: Mirror | None):
        self.engine, self.group, self.mirror = engine, group, mirror
        self.dirty: list[int] = []
        self.broken = False  # a forward pass failed past the batch's checks

    def forward(self, batch: Batch) -> torch.Tensor:
        """Rank 0's logits. A ValueError is the batch's, refused alike on every rank; any
        other failure leaves the ranks out of step (a collective failed, or one rank did
        what the others did not), and `broken` says so."""
        try:
            self.group.broadcast((batch, self.dirty))
            return run_step(self.engine, self.mirror, batch, self.dirty)
        except ValueError:
            raise
        except Exception:
            self.broken = True
            raise

    def stop(self) -> None:
        """End the followers (they take None for the end), then this rank's group."""
        self.group.broadcast(None)
        dist.destroy_process_group()


class MirroredPool(KVPool):
    """The kernel's pool where some shards are mirrors of ranks on other nodes: it notes the
    device pages it changes, which rank 0 sends those ranks before the next step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dirty: set[int] = set()

    def take_dirty(self) -> list[int]:
        pages, self.dirty = sorted(self.dirty), set()
        return pages

    def copy_page(self, src: int, dst: int) -> None:
        super().copy_page(src, dst)
        self.dirty.add(dst)

    def move(self, page: int, src: str, dst: str) -> int:
        new = super().move(page, src, dst)
        if dst == DEVICE:
            self.dirty.add(new)
        return new

    def write_page(self, page: int, k: torch.Tensor, v: torch.Tensor, tier: str = DEVICE) -> None:
        super().write_page(page, k, v, tier)
        if tier == DEVICE:
            self.dirty.add(page)

    def write_rows(self, page: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write_rows(page, start, k, v)
        self.dirty.add(page)

    def write_pages(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        super().write_pages(pages, k, v)
        self.dirty.update(pages)

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        super().move_rows(src, dst)
        self.dirty.update(r // self.page_size for r in dst)

    def rows_changed(self, rows: torch.Tensor) -> None:
        """Rows changed in place through key_layers (kvfs's shift)."""
        self.dirty.update((rows // self.page_size).tolist())


def die_with_parent(parent: int) -> bool:
    """SIGKILL this process when its parent dies; False if the parent is gone already. And
    ignore SIGINT and SIGTERM: a Ctrl-C reaches the whole process group, and the parent
    stops cleanly, then stops us."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return os.getppid() == parent


@dataclass(frozen=True)
class FollowerLaunch:
    """What the kernel tells a follower of node 0's, over its socket."""

    kernel: int  # the kernel's pid
    rank: int
    rendezvous: Rendezvous
    device: str  # "cpu" or "cuda"
    model_dir: Path
    tier: object  # its shard of the pool: a memfd's number, or CUDA tensors
    shape: tuple[int, ...]
    dtype: torch.dtype


def run_follower(
    rank: int,
    rdv: Rendezvous,
    device: str,
    model_dir: Path,
    arrays: tuple[torch.Tensor, torch.Tensor] | None,
    fingerprint: str | None = None,
    token: str | None = None,
) -> int:
    """A follower rank's life: join, build, follow; its exit status. `fingerprint`: its
    checkpoint's, off node 0, for rank 0 to compare with the kernel's; `token`, off node 0,
    its `symphony rank`'s (Claim)."""
    try:
        dev = rank_device(device, rdv, rank)
        cpu_group = join(rdv, claim(rank, rdv, dev, model_dir, fingerprint, token), dev)
        group, engine, mirror = build_follower(rank, rdv, cpu_group, dev, model_dir, arrays)
        try:
            follow(group, engine, mirror)
        except RuntimeError as e:  # gloo's "Connection closed by peer", and the like
            # gloo's own words, less its source file and its advice: "Connection closed
            # by peer [ADDR]:PORT"
            gist = _first_line(e).rpartition("] ")[2].split(". ")[0]
            raise ModelError(f"the group broke: the kernel's rank 0 at {rdv.master_addr}:"
                             f"{rdv.master_port}, or another rank, went away ({gist})") from e
    except Bystander:
        return 1
    except ModelError as e:  # said in a line of its own
        print(f"symphony: {e if str(e).startswith('rank ') else f'rank {rank}: {e}'}",
              file=sys.stderr)
        return 1
    except Exception as e:  # setup failed
        print(f"symphony: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    dist.destroy_process_group()
    return 0


def follower_main(argv: list[str]) -> int:
    """`python -m symphony.ranks`: one follower rank, the kernel's child on node 0 (given
    its socket) or `symphony rank`'s on another node (given the flags)."""
    p = argparse.ArgumentParser(prog="python -m symphony.ranks")
    p.add_argument("--socket", type=int, help="the kernel's socket (node 0)")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--nnodes", type=int)
    p.add_argument("--master-addr")
    p.add_argument("--master-port", type=int)
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--parent", type=int)
    p.add_argument("--model")
    p.add_argument("--fingerprint", help="the checkpoint's (symphony.engine.fingerprint)")
    p.add_argument("--token", help="its `symphony rank`'s, the same for each of its ranks")
    a = p.parse_args(argv)
    if a.socket is not None:
        from symphony.engine_process import mapped, receive  # it imports this module

        with socket.socket(fileno=a.socket) as sock:
            launch: FollowerLaunch = receive(sock)
        if not die_with_parent(launch.kernel):
            return 1
        tier = launch.tier
        arrays = mapped(tier, launch.shape, launch.dtype) if isinstance(tier, int) else tier
        return run_follower(launch.rank, launch.rendezvous, launch.device, launch.model_dir, arrays)
    if not die_with_parent(a.parent):
        return 1
    rdv = Rendezvous(
        a.world, a.nnodes, a.rank // (a.world // a.nnodes), a.master_addr, a.master_port
    )
    return run_follower(a.rank, rdv, a.device, Path(a.model), None, a.fingerprint, a.token)


def start_node(rdv: Rendezvous, device: str, model_dir: Path, fingerprint: str
               ) -> list[subprocess.Popen]:
    """`symphony rank`: start this node's ranks (a node other than 0), with the fingerprint
    of their checkpoint. ModelError, before any starts, for --device cuda where this node
    has no CUDA."""
    if device == "cuda":
        require_cuda()
    # torch's C++ warnings off (a rank whose kernel stops while it waits for its verdict
    # printed TCPStore's 'recvValueWithTimeout failed' and its C++ frames before its line).
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    token = secrets.token_hex(8)  # this node's, in each of its ranks' claims
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "symphony.ranks",
                "--rank",
                str(r),
                "--world",
                str(rdv.world),
                "--nnodes",
                str(rdv.nnodes),
                "--master-addr",
                rdv.master_addr,
                "--master-port",
                str(rdv.master_port),
                "--device",
                device,
                "--parent",
                str(os.getpid()),
                "--model",
                str(model_dir),
                "--fingerprint",
                fingerprint,
                "--token",
                token,
            ],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        for r in rdv.local_ranks()
    ]


if __name__ == "__main__":
    # This module's classes under their own name, not __main__'s: what a follower pickles
    # for rank 0 over the formed group (its RankInfo) is unpickled there by that name.
    from symphony.ranks import follower_main as main

    status = main(sys.argv[1:])
    # Out without the interpreter's finalization: gloo's threads and their buffers, torn
    # down there while the other ranks exit too, now and then end in std::terminate (an
    # exit status of -6 for a rank that ended cleanly).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

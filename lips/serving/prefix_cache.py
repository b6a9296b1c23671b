"""Prefix caching as a program: KV files of recent prompts' page-aligned prefixes.

vLLM and SGLang keep prefix caches inside their engines; here the server keeps anonymous KV
files and starts each request by forking (copy-on-write) the one holding the longest cached
prefix of its prompt, so only the rest of the prompt is computed.

The index is a radix tree over pages (SGLang's, one page per edge): a node is one page-sized
block of token ids under its parent, so a node stands for the whole prefix up to it. vLLM's
hash chain (block i's key hashes block i-1's key and block i's ids) is the same walk; the
tree's edges are the ids themselves, so a lookup compares tokens and a hash collision can
never serve another prompt's prefix.

An entry is one cached file; the nodes of its prefix list it as a holder. A node is one
physical page: an entry is built by forking the entry that holds the longest cached prefix
of it and splicing the rest on from the caller's file (whole aligned pages are shared, not
copied), so every entry holding a node shares that node's page. `pages` is therefore the
number of nodes: the pages the cache's files hold, each counted once however many entries
share it (a page a request's file also shares still counts: it stays while the cache holds
it). Whole entries are evicted, least recently used first, while `pages` is past the budget;
an entry whose prefix a newer one extends is dropped at once (the newer holds all of it).

The cache also decides who gets memory when the kernel has none (making_room). Each request
in flight holds a Claim (claim() ... release()). A request's syscall the kernel refuses for
want of memory (ENOSPC, EDQUOT) is made again at once after the least recently used entry
is evicted; with no entry left, it waits until another request ends or pages are freed and
is made again then (the waiting requests oldest first), for at most WAIT_S in all. When
every request in flight waits (none would free a page), the youngest of those holding
pages is preempted, as vLLM's recompute preemption: its call raises Preempted, the request
frees its KV files and calls preempted(), which returns once pages may have been freed
again (so it does not take back the pages it just gave up), and the request computes its
prompt and the tokens it has generated again and goes on. A request fails only when its
wait is used up, or no other request is in flight, or every request in flight waits and
no other holds pages (it alone does and cannot get more; or none does and the oldest
fails, the pool held by others than the server).

Index updates happen under one lock (inserts and evictions: off the token path); `open`
reads the index without awaiting and pins the entry it forks, so an eviction meanwhile
closes that file only once the fork is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from syscalls.aio import AsyncFile, AsyncKernel

log = logging.getLogger(__name__)
T = TypeVar("T")

# The kernel has no memory to spare: the cache gives some back instead of caching more.
_OUT_OF_MEMORY = (errno.ENOSPC, errno.EDQUOT)
WAIT_S = 60.0  # a request's wait for memory, in all, before its ENOSPC/EDQUOT stands


@dataclass(eq=False)
class _Node:
    """One cached page: the block of ids `block` after the prefix its parent stands for."""

    parent: _Node | None
    block: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    holders: dict[_Entry, None] = field(default_factory=dict)  # oldest first


@dataclass(eq=False)
class _Entry:
    """One cached file, holding the prefix of `nodes` (root's child first)."""

    file: AsyncFile
    nodes: list[_Node]
    pins: int = 0  # opens forking this file now
    dropped: bool = False


# What a waiting call is woken with: make the call again, fail, or give the request's pages
# up (Preempted).
_AGAIN, _FAIL, _PREEMPT = "again", "fail", "preempt"


@dataclass(eq=False)
class Claim:
    """One request in flight, as the wait for memory sees it (PrefixCache.claim)."""

    left: float = WAIT_S  # seconds it may still wait
    wakes: list[asyncio.Future[str]] = field(default_factory=list)  # its waits now
    # Whether it may hold pages: a call of its succeeded (or its file came from the cache
    # holding a prefix) since it started or was last preempted. Preempting one that holds
    # none would free nothing.
    holds: bool = False


class Preempted(Exception):
    """making_room's call was given up so that the older requests get memory: the request
    closes its KV files, then awaits PrefixCache.preempted() before it computes them again.
    `error` is the call's refusal (ENOSPC, EDQUOT), the request's error if it cannot go
    on."""

    def __init__(self, error: OSError, seen: int):
        super().__init__(str(error))
        self.error = error
        self.seen = seen  # PrefixCache._changes when it was preempted


class PrefixCache:
    """KV files of recent prompts' page-aligned prefixes, LRU under a page budget."""

    def __init__(self, kernel: AsyncKernel, page_size: int, budget_pages: int):
        self.kernel = kernel
        self.page_size = page_size
        self.budget_pages = budget_pages
        self.queries = 0  # prompt tokens looked up, ever
        self.hits = 0  # of them, found in the cache
        self.pages = 0  # pages the cache holds now (its own, not shared)
        self._root = _Node(None, ())
        self._lru: dict[_Entry, None] = {}  # least recently used first
        self._lock = asyncio.Lock()
        self._claims: dict[Claim, None] = {}  # the requests in flight, oldest first
        self._changes = 0  # requests ended and entries closed, ever: pages maybe freed

    def _blocks(self, tokens: list[int], pages: int) -> Iterator[tuple[int, ...]]:
        p = self.page_size
        return (tuple(tokens[i * p:(i + 1) * p]) for i in range(pages))

    def _walk(self, blocks: Iterable[tuple[int, ...]]) -> list[_Node]:
        """The cached nodes of the longest cached prefix of `blocks`."""
        path, node = [], self._root
        for block in blocks:
            child = node.children.get(block)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _touch(self, entry: _Entry) -> None:
        del self._lru[entry]
        self._lru[entry] = None

    @staticmethod
    def _holder(node: _Node) -> _Entry:
        return next(reversed(node.holders))  # the newest: the likeliest to be used again

    async def open(self, prompt: list[int]) -> tuple[AsyncFile, int]:
        """A new file for the caller (the caller closes it) holding the longest cached
        page-aligned prefix of prompt[:-1] (so at least one prompt token is left to send),
        and that prefix's length; a fresh anonymous file and 0 when nothing matches.
        Counts queries (len(prompt) tokens) and hits (the length)."""
        self.queries += len(prompt)
        if self.budget_pages <= 0:
            return await self.kernel.open(), 0
        path = self._walk(self._blocks(prompt, (len(prompt) - 1) // self.page_size))
        if not path:
            return await self.kernel.open(), 0
        entry = self._holder(path[-1])
        self._touch(entry)
        length = len(path) * self.page_size
        entry.pins += 1
        try:
            file = await self._fork(entry.file, length, len(entry.nodes) > len(path))
        except OSError as e:  # a cache that cannot serve is a miss, never a failure
            log.debug("prefix cache: fork failed, a miss: %s", e)
            return await self.kernel.open(), 0
        finally:
            entry.pins -= 1
            if entry.dropped and not entry.pins:
                await self._close(entry)
        self.hits += length
        return file, length

    async def _fork(self, source: AsyncFile, length: int, cut: bool) -> AsyncFile:
        """A fork of `source`, truncated to `length` when `cut`; closed again on failure."""
        file = await source.fork()
        try:
            if cut:
                await file.truncate(length)
        except BaseException:
            with contextlib.suppress(OSError):
                await file.close()
            raise
        return file

    async def insert(self, prompt: list[int], file: AsyncFile) -> None:
        """Remember the page-aligned prefix of `prompt` that `file` holds (file holds at
        least len(prompt) // page_size * page_size entries of prompt): forks it, so the
        caller keeps its file. Evicts least recently used entries past the budget."""
        pages = len(prompt) // self.page_size
        if not 0 < pages <= self.budget_pages:
            return
        blocks = list(self._blocks(prompt, pages))
        async with self._lock:
            if self.budget_pages <= 0:  # closed meanwhile
                return
            path = self._walk(blocks)
            if len(path) == pages:  # cached already
                self._touch(self._holder(path[-1]))
                return
            try:
                copy = await self._build(file, path, pages)
            except OSError as e:  # the cache is an optimisation: it never fails a request
                log.debug("prefix cache: insert failed: %s", e)
                if e.errno in _OUT_OF_MEMORY and self._lru:
                    await self._drop(next(iter(self._lru)))
                return
            for old in self._add(copy, path, blocks):
                if not old.pins:
                    await self._close(old)
            while self.pages > self.budget_pages:
                await self._drop(next(iter(self._lru)))

    async def _build(self, file: AsyncFile, path: list[_Node], pages: int) -> AsyncFile:
        """The new entry's file: the cached prefix `path` forked from its holder (sharing
        its pages), the rest of the `pages` spliced on from `file`."""
        length = pages * self.page_size
        if not path:
            return await self._fork(file, length, True)
        holder = self._holder(path[-1])
        start = len(path) * self.page_size
        copy = await self._fork(holder.file, start, len(holder.nodes) > len(path))
        try:
            await copy.splice_from(file, start, length)
        except BaseException:
            with contextlib.suppress(OSError):
                await copy.close()
            raise
        return copy

    def _add(
        self, file: AsyncFile, path: list[_Node], blocks: list[tuple[int, ...]]
    ) -> list[_Entry]:
        """Index the entry of `file`, holding `blocks`, of which `path` is cached already;
        the entries it makes redundant (their prefix is a prefix of it) are taken out of
        the index and returned, for the caller to close."""
        nodes = list(path)
        parent = nodes[-1] if nodes else self._root
        for block in blocks[len(path):]:
            child = _Node(parent, block)
            parent.children[block] = child
            self.pages += 1
            nodes.append(child)
            parent = child
        entry = _Entry(file, nodes)
        for node in nodes:
            node.holders[entry] = None
        self._lru[entry] = None
        redundant = [e for node in path for e in node.holders if e.nodes[-1] is node]
        for old in redundant:  # the new entry holds their nodes: no page goes
            self._unindex(old)
        return redundant

    def _unindex(self, entry: _Entry) -> None:
        """Take `entry` out of the index: the nodes no other entry holds go."""
        entry.dropped = True
        del self._lru[entry]
        for node in entry.nodes:
            del node.holders[entry]
            if not node.holders:
                assert node.parent is not None
                del node.parent.children[node.block]
                self.pages -= 1

    async def _drop(self, entry: _Entry) -> None:
        self._unindex(entry)
        if not entry.pins:
            await self._close(entry)

    async def _close(self, entry: _Entry) -> None:
        with contextlib.suppress(OSError):  # the kernel gone: nothing left to free
            await entry.file.close()
        self._changed()

    def claim(self) -> Claim:
        """A request is in flight (until release): making_room's calls are its."""
        claim = Claim()
        self._claims[claim] = None
        return claim

    def release(self, claim: Claim) -> None:
        """The request has ended, its files closed: the waiting requests try again."""
        del self._claims[claim]
        self._changed()

    def _changed(self) -> None:
        """Pages may have been freed: every waiting request tries again, oldest first (the
        order their calls reach the kernel)."""
        self._changes += 1
        for claim in self._claims:
            self._wake(claim, _AGAIN)

    @staticmethod
    def _wake(claim: Claim, verdict: str) -> None:
        for wake in claim.wakes:
            if not wake.done():
                wake.set_result(verdict)
        claim.wakes.clear()

    async def making_room(self, call: Callable[[], Awaitable[T]], claim: Claim) -> T:
        """call()'s result, made by claim's request; while it fails for want of memory
        (ENOSPC: the kernel's pool is full; EDQUOT: the session's quota, which the cache's
        pages count against), the least recently used entry is evicted and call() made
        again; with the cache empty, call() is made again once another request ends or
        pages are freed (_wait), or Preempted is raised when the request is to give its
        pages up. `call` must be one a failure leaves undone (a syscall: a failed call
        changes nothing)."""
        while True:
            seen = self._changes
            try:
                result = await call()
            except OSError as e:
                if e.errno not in _OUT_OF_MEMORY:
                    raise
                if await self._evict():
                    continue
                verdict = await self._wait(claim, seen)
                if verdict == _PREEMPT:
                    raise Preempted(e, self._changes) from e
                if verdict == _FAIL:
                    raise
            else:
                claim.holds = True
                return result

    async def preempted(self, claim: Claim, preemption: Preempted) -> None:
        """Claim's request, preempted, has closed its files: the waiting requests try
        again now, and this returns once pages may have been freed since (another request
        ended, or was preempted, or the cache closed a file), for the request to compute
        its KV again; raises the preemption's error when its wait is used up first."""
        claim.holds = False
        freed_meanwhile = self._changes != preemption.seen
        self._changed()
        if not freed_meanwhile and await self._wait(claim, self._changes) == _FAIL:
            raise preemption.error

    async def _wait(self, claim: Claim, seen: int) -> str:
        """What claim's failed call (made when _changes was `seen`) does: _AGAIN (at once
        if pages may have been freed since; else once they may be, within claim's wait
        left), _FAIL when no other request is in flight, its wait is used up, or every
        request in flight waits and no other holds pages (it holds some, or none does and
        it is the oldest), or _PREEMPT when every request in flight waits and it is the
        youngest of two or more holding pages."""
        if self._changes != seen:
            return _AGAIN
        if claim.left <= 0 or len(self._claims) < 2:
            return _FAIL
        loop = asyncio.get_running_loop()
        start = loop.time()
        wake: asyncio.Future[str] = loop.create_future()
        claim.wakes.append(wake)
        if all(c.wakes for c in self._claims):  # no request would free a page
            holders = [c for c in self._claims if c.holds]
            if len(holders) > 1:
                self._wake(holders[-1], _PREEMPT)  # the youngest gives its pages up
            else:  # it cannot get more, ever; with no holder, what holds the pool is not
                # the server's (the cache is empty): the oldest gives up, as it would alone
                self._wake(holders[0] if holders else next(iter(self._claims)), _FAIL)
        try:
            return await asyncio.wait_for(wake, claim.left)
        except TimeoutError:
            return _FAIL
        finally:
            claim.left -= loop.time() - start
            if wake in claim.wakes:
                claim.wakes.remove(wake)

    async def _evict(self) -> bool:
        """Evict the least recently used entry; False when there is none."""
        async with self._lock:
            if not self._lru:
                return False
            await self._drop(next(iter(self._lru)))
            return True

    async def close(self) -> None:
        """Close every cached file; the cache is disabled after."""
        async with self._lock:
            self.budget_pages = 0
            while self._lru:
                await self._drop(next(iter(self._lru)))

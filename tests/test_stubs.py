"""The clients' plain syscall methods (syscalls/usys.py) are what `make stubs` makes from the
table in syscalls/stubs.py and the builders in syscalls/convert.py."""

from __future__ import annotations

import pytest

from syscalls import stubs
from syscalls.aio import AsyncFile, AsyncKernel
from syscalls.client import File, Kernel
from syscalls.usys import AsyncFileCalls, AsyncKernelCalls, FileCalls, KernelCalls


def test_usys_is_fresh():
    assert stubs.render() == stubs.OUT.read_text(), "syscalls/usys.py is stale: run `make stubs`"


def test_a_row_makes_the_methods_of_both_clients():
    text = stubs.render([stubs.Syscall("splice", file_as="dst", file_method="splice_from")])
    assert "    def splice(self, src: Fd, start: int, end: int, dst: Fd) -> None:\n" in text
    assert "        await self._do(convert.splice(src, start, end, dst))\n" in text
    assert "    async def splice_from(self, src: Fd, start: int, end: int) -> None:\n" in text
    assert "        self.kernel.splice(src, start, end, self)\n" in text


def test_a_row_names_a_builder_and_its_file_argument():
    with pytest.raises(ValueError, match="no builder nope"):
        stubs.render([stubs.Syscall("nope")])
    with pytest.raises(ValueError, match="no argument 'fd'"):
        stubs.render([stubs.Syscall("stat", file_as="fd")])


@pytest.mark.parametrize("cls, calls", [(Kernel, KernelCalls), (File, FileCalls),
                                        (AsyncKernel, AsyncKernelCalls),
                                        (AsyncFile, AsyncFileCalls)])
def test_no_hand_written_method_hides_a_made_one(cls, calls):
    assert {name for name in vars(calls) if not name.startswith("_")} & set(vars(cls)) == set()

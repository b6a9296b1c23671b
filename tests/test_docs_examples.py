"""The examples of docs/syscalls.md run as written on a real kernel: programs are written
from them, so an example that no longer runs is a broken promise."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "syscalls.md"


def examples() -> list[str]:
    """The doc's python blocks that run on an open session `k` (those that connect one of
    their own need a kernel at the default socket, and the asyncio ones a loop)."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return [b for b in blocks if "connect(" not in b and "async def" not in b]


def test_the_examples_run_in_order_on_one_session(k):
    blocks = examples()
    assert len(blocks) >= 5 and any("parents=" in b for b in blocks)
    namespace = {"k": k}
    for block in blocks:  # in the doc's order: a later one may use an earlier one's names
        exec(compile(block, str(DOC), "exec"), namespace)
    assert namespace["outs"] and namespace["out"].token >= 0

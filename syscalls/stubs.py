"""The plain syscalls, one row each, and what makes their client methods from them, as xv6's
usys.pl makes its user stubs: `make stubs` (python -m syscalls.stubs) writes syscalls/usys.py,
the typed methods of Kernel, File, AsyncKernel and AsyncFile for every row, each taking its
signature, defaults and docstring from the row's builder in syscalls/convert.py.
tests/test_stubs.py fails when the file is stale. Adding a plain syscall then touches the proto,
its builder, its row here, the kernel's handler and the docs (docs/architecture.md).

A plain syscall's method runs its builder's Call and returns the result (Kernel.truncate(fd,
length)); its File method passes the file as one argument (File.truncate(length)). The calls
that do more are written by hand in syscalls/client.py and syscalls/aio.py instead:
- connect: a classmethod that makes the session (the hello handshake, the channel, attach);
- close: close(fd) is the syscall but close() ends the session, and File.close marks the
  file closed;
- attach: keeps the identity the kernel answers; exit: ends the session, answered or not;
- pred: the lifeline's fast path, and a sampler from keywords;
- export_iter and export: a server stream; import_file: a client stream of chunks (on
  AsyncKernel, from an async iterable too).
acting_as and lifeline are no syscalls: they are the session's.
"""

from __future__ import annotations

import ast
import builtins
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CONVERT = Path(__file__).with_name("convert.py")
OUT = Path(__file__).with_name("usys.py")
WIDTH = 100  # ruff's line length
INDENT = " " * 8  # a method's body


@dataclass(frozen=True)
class Syscall:
    name: str  # its builder in syscalls/convert.py, and Kernel's method
    file_as: str | None = None  # the builder's argument a File method fills with the file
    file_method: str | None = None  # that File method's name, when it is not `name`
    opens: bool = False  # the result is an fd: the method returns it as a File (AsyncFile)


# In the proto's order.
SYSCALLS = (
    Syscall("getpid"),
    Syscall("ps"),
    Syscall("kill"),
    Syscall("nice"),
    Syscall("model_info"),
    Syscall("tokenize"),
    Syscall("detokenize"),
    Syscall("vocab"),
    Syscall("open", opens=True),
    Syscall("fork", file_as="fd", opens=True),
    Syscall("link", file_as="fd"),
    Syscall("read", file_as="fd"),
    Syscall("splice", file_as="dst", file_method="splice_from"),
    Syscall("truncate", file_as="fd"),
    Syscall("punch", file_as="fd"),
    Syscall("keep", file_as="fd"),
    Syscall("shift", file_as="fd"),
    Syscall("stat", file_as="target"),
    Syscall("readdir"),
    Syscall("mkdir"),
    Syscall("rmdir"),
    Syscall("unlink"),
    Syscall("rename"),
    Syscall("chmod"),
    Syscall("access"),
    Syscall("chown"),
    Syscall("fsync", file_as="fd"),
    Syscall("procfs"),
)


@dataclass(frozen=True)
class Builder:
    """A builder as convert.py writes it."""

    params: list[tuple[str, str]]  # (name, "name: annotation[ = default]")
    result: str  # T of its Call[T]
    doc: str | None
    names: set[str]  # the names its annotations and defaults use


def _builder(fn: ast.FunctionDef, source: str) -> Builder:
    args, where = fn.args, f"syscalls/convert.py: {fn.name}"
    if args.posonlyargs or args.vararg or args.kwonlyargs or args.kwarg:
        raise ValueError(f"{where}: a plain syscall's builder takes plain arguments only")
    returns = fn.returns
    if not (isinstance(returns, ast.Subscript) and ast.unparse(returns.value) == "Call"):
        raise ValueError(f"{where}: a plain syscall's builder returns a Call[...]")
    defaults = [None] * (len(args.args) - len(args.defaults)) + args.defaults
    params, used = [], [returns.slice]
    for arg, default in zip(args.args, defaults, strict=True):
        if arg.annotation is None:
            raise ValueError(f"{where}: {arg.arg} has no type")
        text = f"{arg.arg}: {ast.get_source_segment(source, arg.annotation)}"
        if default is not None:
            text += f" = {ast.get_source_segment(source, default)}"
            used.append(default)
        params.append((arg.arg, text))
        used.append(arg.annotation)
    names = {n.id for node in used for n in ast.walk(node) if isinstance(n, ast.Name)}
    return Builder(params, ast.get_source_segment(source, returns.slice),
                   ast.get_docstring(fn), names - set(dir(builtins)))


def _imports(tree: ast.Module, names: set[str], own: dict[str, set[str]]) -> list[str]:
    """The import lines, in ruff's isort order, for `names` as convert.py imports them (what
    it defines itself, from syscalls.convert), and for `own` (module -> names)."""
    origins: dict[str, str | None] = {}  # name -> the module it is from (None: `import name`)
    for node in tree.body:
        if isinstance(node, ast.Import):
            origins.update((a.asname or a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            origins.update((a.asname or a.name, node.module) for a in node.names)
    straight = {name for name in names if name in origins and origins[name] is None}
    froms = {module: set(members) for module, members in own.items()}
    for name in names - straight:
        froms.setdefault(origins.get(name) or "syscalls.convert", set()).add(name)

    def section(module: str) -> int:  # the standard library, others, the project
        top = module.split(".")[0]
        return 0 if top in sys.stdlib_module_names else 2 if top == "syscalls" else 1

    def member(name: str) -> tuple[bool, bool, str]:  # constants, then classes, then the rest
        return not name.isupper(), not name[:1].isupper(), name

    sections: list[list[str]] = [[], [], []]
    for module in sorted(straight):
        sections[section(module)].append(f"import {module}")
    for module in sorted(froms):
        members = ", ".join(sorted(froms[module], key=member))
        sections[section(module)].append(f"from {module} import {members}")
    return [line for lines in sections if lines for line in ["", *lines]]


def _wrapped(head: str, items: list[str], tail: str) -> list[str]:
    """head, the items and tail on one line if it fits, else one item a line."""
    line = head + ", ".join(items) + tail
    if len(line) <= WIDTH:
        return [line]
    indent = " " * (len(head) - len(head.lstrip()))
    return [head, *(f"{indent}    {item}," for item in items), indent + tail.lstrip()]


def _docstring(doc: str, indent: str) -> list[str]:
    """`doc`'s paragraphs refilled at `indent` (a builder's are one level shallower)."""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    paragraphs[0] = '"""' + paragraphs[0]
    paragraphs[-1] += '"""'
    lines: list[str] = []
    for paragraph in paragraphs:
        lines += ([""] if lines else []) + textwrap.wrap(
            paragraph, WIDTH, initial_indent=indent, subsequent_indent=indent,
            break_long_words=False, break_on_hyphens=False)
    return lines


def _method(is_async: bool, name: str, params: list[str], returns: str, doc: str | None,
            call: str, args: list[str]) -> list[str]:
    """A method whose body is `call` (an expression open for its arguments) on `args`,
    returned unless the method returns None."""
    lines = _wrapped(f"    {'async ' if is_async else ''}def {name}(", ["self", *params],
                     f") -> {returns}:")
    lines += _docstring(doc, INDENT) if doc else []
    head = INDENT + ("" if returns == "None" else "return ") + call
    return ["", *lines, *_wrapped(head, args, ")" * call.count("("))]


def _classes(table: list[Syscall], builders: dict[str, Builder], is_async: bool) -> list[str]:
    """Kernel's and File's mixins (AsyncKernel's and AsyncFile's when `is_async`)."""
    prefix, awaited = ("Async", "await ") if is_async else ("", "")
    kernel, file = f"{prefix}Kernel", f"{prefix}File"
    on_kernel = [f"class {kernel}Calls:", *_docstring(
        f"{kernel}'s plain syscalls (syscalls/stubs.py): each runs its builder's Call with "
        "`self._do`, and `self._file` makes an fd an open file.", "    ")]
    on_file = [f"class {file}Calls:", *_docstring(
        f"{file}'s plain syscalls: {kernel}'s on this file (`self.kernel`).", "    ")]
    for s in table:
        b = builders[s.name]
        names = [n for n, _ in b.params]
        returns, call = b.result, f"{awaited}self._do(convert.{s.name}("
        if s.opens:
            returns, call = file, f"self._file({call}"
        on_kernel += _method(is_async, s.name, [p for _, p in b.params], returns, b.doc, call,
                             names)
        if s.file_as is None:
            continue
        if s.file_as not in names:
            raise ValueError(f"{s.name}: its builder has no argument {s.file_as!r}")
        where = "on this file" if names[0] == s.file_as else f"with this file as `{s.file_as}`"
        on_file += _method(is_async, s.file_method or s.name,
                           [p for n, p in b.params if n != s.file_as], returns,
                           f"{kernel}.{s.name} {where}.", f"{awaited}self.kernel.{s.name}(",
                           ["self" if n == s.file_as else n for n in names])
    return [*on_kernel, "", "", *on_file]


def render(table: Iterable[Syscall] = SYSCALLS) -> str:
    """usys.py's text for `table`."""
    table = list(table)
    source = CONVERT.read_text()
    tree = ast.parse(source)
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [s.name for s in table if s.name not in fns]
    if missing:
        raise ValueError(f"syscalls/convert.py has no builder {', '.join(missing)}")
    builders = {s.name: _builder(fns[s.name], source) for s in table}
    opens = any(s.opens for s in table)  # File and AsyncFile are named, for type checkers only
    own = {"syscalls": {"convert"}} | ({"typing": {"TYPE_CHECKING"}} if opens else {})
    used = set().union(*(b.names for b in builders.values()))
    lines = [
        '"""Made by `make stubs` (python -m syscalls.stubs) from its table of plain syscalls and',
        "their builders in syscalls/convert.py: do not edit. Kernel, File, AsyncKernel and",
        'AsyncFile take their plain syscalls\' methods from these mixins."""',
        "",
        "from __future__ import annotations",
        *_imports(tree, used, own),
    ]
    if opens:
        lines += ["", "if TYPE_CHECKING:", "    from syscalls.aio import AsyncFile",
                  "    from syscalls.client import File"]
    for is_async in (False, True):
        lines += ["", "", *_classes(table, builders, is_async)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())

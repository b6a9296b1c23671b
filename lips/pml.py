"""Prompt Markup Language: the schema and prompt files of lips/prompt_cache.py, in XML as the
Prompt Cache paper (Gim et al., MLSys 2024) writes them.

A schema declares modules in order; each gets a fixed range of positions (lips/prompt_cache.py
lays them out with the model's tokenizer). A union's modules share one range: a prompt uses
at most one of them. A parameter is a hole of `len` positions inside a module, filled when a
prompt uses the module:

    <schema name="travel">
      <module name="system">You are a travel guide.</module>
      <union>
        <module name="paris">Paris is ...</module>
        <module name="tokyo">Tokyo is ...</module>
      </union>
      <module name="plan">Plan a trip of <parameter name="days" len="4"/> days.</module>
    </schema>

A prompt names the modules it uses as empty elements, parameters as attributes, and ends
with its own text, the question:

    <prompt schema="travel"><system/><tokyo/><plan days="3"/>What should I see first?</prompt>

A module's text is its content as written, without the whitespace at its two ends, followed
by one newline, so that modules read as lines whichever of them a prompt leaves out. Every
malformed element is a PMLError (a ValueError) naming it.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from itertools import pairwise

# A module is named by an element in prompts, so its name must be an XML name (ASCII here).
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")


class PMLError(ValueError):
    """A schema or prompt the markup does not allow; the message names the element."""


@dataclass(frozen=True)
class Parameter:
    name: str
    length: int  # positions reserved: the most tokens an argument may have


@dataclass(frozen=True)
class Module:
    name: str
    pieces: tuple[str | Parameter, ...]  # text and parameters, in order
    union: int | None  # the index of its union among the schema's, None outside one

    @property
    def parameters(self) -> dict[str, Parameter]:
        return {p.name: p for p in self.pieces if isinstance(p, Parameter)}


@dataclass(frozen=True)
class Schema:
    name: str
    items: tuple[Module | tuple[Module, ...], ...]  # a module, or a union's members

    @property
    def modules(self) -> dict[str, Module]:
        return {
            m.name: m for item in self.items for m in (item if isinstance(item, tuple) else (item,))
        }


@dataclass(frozen=True)
class Prompt:
    modules: tuple[str, ...]  # in the schema's order
    arguments: dict[str, dict[str, str]]  # module -> parameter -> text
    question: str


def _parse(text: str, what: str) -> ET.Element:
    try:
        return ET.fromstring(text)
    except ET.ParseError as e:
        raise PMLError(f"{what}: not well-formed XML: {e}") from None


def _blank(text: str | None) -> bool:
    return text is None or not text.strip()


def _name(element: ET.Element, where: str) -> str:
    name = element.get("name")
    if name is None:
        raise PMLError(f"{where}: <{element.tag}> has no name")
    if not NAME.match(name):
        raise PMLError(
            f"{where}: <{element.tag} name={name!r}>: a name must be an XML name "
            "(a letter or _, then letters, digits, _ . -)"
        )
    return name


def _unknown_attributes(element: ET.Element, allowed: set[str], where: str) -> None:
    extra = sorted(set(element.attrib) - allowed)
    if extra:
        raise PMLError(f"{where}: <{element.tag}> has unknown attribute {extra[0]!r}")


def _parameter(element: ET.Element, where: str) -> Parameter:
    name = _name(element, where)
    _unknown_attributes(element, {"name", "len"}, where)
    length = element.get("len")
    if length is None or not length.isdigit() or int(length) < 1:
        raise PMLError(
            f"{where}: <parameter name={name!r}> needs len, a whole number of "
            f"tokens >= 1 (got {length!r})"
        )
    if len(element) or not _blank(element.text):
        raise PMLError(f"{where}: <parameter name={name!r}> must be empty")
    return Parameter(name, int(length))


def _module(element: ET.Element, union: int | None) -> Module:
    name = _name(element, "schema")
    where = f"module {name!r}"
    _unknown_attributes(element, {"name"}, "schema")
    pieces: list[str | Parameter] = [element.text or ""]
    for child in element:
        if child.tag != "parameter":
            raise PMLError(f"{where}: <{child.tag}> inside a module (only <parameter> may be)")
        parameter = _parameter(child, where)
        if any(isinstance(p, Parameter) and p.name == parameter.name for p in pieces):
            raise PMLError(f"{where}: parameter {parameter.name!r} twice")
        pieces += [parameter, child.tail or ""]
    pieces[0], pieces[-1] = pieces[0].lstrip(), pieces[-1].rstrip() + "\n"
    if len(pieces) == 1 and pieces[0] == "\n":
        raise PMLError(f"{where} is empty")
    return Module(name, tuple(p for p in pieces if p != ""), union)


def parse_schema(text: str) -> Schema:
    root = _parse(text, "schema")
    if root.tag != "schema":
        raise PMLError(f"schema: the root element is <{root.tag}>, not <schema>")
    name = _name(root, "schema")
    _unknown_attributes(root, {"name"}, "schema")
    items: list[Module | tuple[Module, ...]] = []
    unions = 0
    for child in root:
        if child.tag == "module":
            items.append(_module(child, None))
        elif child.tag == "union":
            _unknown_attributes(child, set(), "schema")
            members = [_module(m, unions) if m.tag == "module" else m for m in child]
            bad = [m for m in members if not isinstance(m, Module)]
            if bad or not members:
                what = f"<{bad[0].tag}>" if bad else "nothing"
                raise PMLError(
                    f"schema: <union> #{unions + 1} holds {what} "
                    "(a union holds modules only, at least one)"
                )
            if any(not _blank(m.tail) for m in child) or not _blank(child.text):
                raise PMLError(f"schema: <union> #{unions + 1} holds text outside its modules")
            items.append(tuple(members))
            unions += 1
        else:
            raise PMLError(f"schema: <{child.tag}> (a schema holds <module> and <union>)")
    if not _blank(root.text) or any(not _blank(c.tail) for c in root):
        raise PMLError("schema: text outside a module")
    if not items:
        raise PMLError(f"schema {name!r} declares no module")
    names = [m.name for item in items for m in (item if isinstance(item, tuple) else (item,))]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise PMLError(f"schema: module {twice!r} declared twice")
    return Schema(name, tuple(items))


def parse_prompt(text: str, schema: Schema) -> Prompt:
    """A prompt against `schema`: which modules, their arguments, and the question."""
    root = _parse(text, "prompt")
    if root.tag != "prompt":
        raise PMLError(f"prompt: the root element is <{root.tag}>, not <prompt>")
    _unknown_attributes(root, {"schema"}, "prompt")
    if root.get("schema", schema.name) != schema.name:
        raise PMLError(f"prompt: it is for schema {root.get('schema')!r}, not {schema.name!r}")
    if len(root) and (not _blank(root.text) or any(not _blank(c.tail) for c in root[:-1])):
        raise PMLError("prompt: text before a module (the question comes after them all)")
    modules, arguments = schema.modules, {}
    for child in root:
        module = modules.get(child.tag)
        if module is None:
            raise PMLError(f"prompt: <{child.tag}> is not a module of schema {schema.name!r}")
        if child.tag in arguments:
            raise PMLError(f"prompt: <{child.tag}> twice")
        if len(child) or not _blank(child.text):
            raise PMLError(f"prompt: <{child.tag}> must be empty (arguments are attributes)")
        params = module.parameters
        _unknown_attributes(child, set(params), "prompt")
        missing = sorted(set(params) - set(child.attrib))
        if missing:
            raise PMLError(f'prompt: <{child.tag}> needs {missing[0]}="..."')
        arguments[child.tag] = dict(child.attrib)
    used = [m for m in modules.values() if m.name in arguments]
    for a, b in pairwise(used):
        if a.union is not None and a.union == b.union:
            raise PMLError(f"prompt: <{a.name}> and <{b.name}> are of one union: use one")
    question = (root[-1].tail if len(root) else root.text) or ""
    if _blank(question):
        raise PMLError("prompt: no question after the modules")
    return Prompt(tuple(m.name for m in used), arguments, question.strip())

"""Build the default model's corpus from pinned Debian packages, the same bytes everywhere.

English: the reStructuredText sources of the Python 3.11 documentation (python3.11-doc),
turned into plain text. Python: the standard library's sources (libpython3.11-minimal and
-stdlib). Chat: one question and answer per documented library function or class, so the
chat markers are trained tokens rather than random embeddings.

Output, in `DATA/corpus/`: train.txt and eval.txt are token streams written as text, each
document `<|bos|>...<|eos|>` (chat documents carry their own turn markers), and
manifest.json with the counts and digests. Every source file goes to eval.txt or
train.txt by a hash of its name, so the eval slice is held out whole files at a time.

    python models/prepare_corpus.py [--data data]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import shutil
import subprocess
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from default_tokenizer import BOS, EOS, render_chat

EVAL_PERCENT = 5


@dataclass(frozen=True)
class Deb:
    name: str
    version: str
    arch: str
    sha256: str
    sha1: str  # snapshot.debian.org serves every file it ever archived by its sha1

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_{self.arch}.deb"


PACKAGES = [
    Deb(
        "python3.11-doc",
        "3.11.2-6+deb12u8",
        "all",
        "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
        "d4a9ab01ca393dc30872e1ea65f14be24cfcfe73",
    ),
    Deb(
        "libpython3.11-minimal",
        "3.11.2-6+deb12u8",
        "amd64",
        "f3beaa03994ffedacf73c43a0843d53b062d347115d8af65bee2034552a4e6f9",
        "5ca03246bbe926929a57e43222227a7efad1d93f",
    ),
    Deb(
        "libpython3.11-stdlib",
        "3.11.2-6+deb12u8",
        "amd64",
        "890b3540dad8a1ccc0deeca025db735bcc82629a76adacbe3b50fcc06ed528ca",
        "85fd8963262ea1caac4a3a5d74227bf19c11c6fe",
    ),
]

DOC_ROOT = "./usr/share/doc/python3.11/html/_sources/"
LIB_ROOT = "./usr/lib/python3.11/"
# Codec tables and the pydoc topic dump (a copy of the docs) would teach nothing useful.
LIB_SKIP = ("encodings/", "pydoc_data/", "_sysconfigdata", "config-3.11")


# ---------------------------------------------------------------- fetching the packages


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fetch(deb: Deb, cache: Path) -> Path:
    """The verified .deb: from the cache, apt, or Debian's pool and snapshot archive."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / deb.filename
    if path.exists() and _sha256(path) == deb.sha256:
        return path
    if shutil.which("apt-get"):
        # apt on another release may not know this version: the URLs below still work.
        subprocess.run(
            ["apt-get", "download", "-q", f"{deb.name}={deb.version}"], cwd=cache, check=False
        )
    urls = [
        f"http://deb.debian.org/debian/pool/main/p/python3.11/{deb.filename}",
        f"https://snapshot.debian.org/file/{deb.sha1}",
    ]
    for url in urls:
        if path.exists() and _sha256(path) == deb.sha256:
            break
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                path.write_bytes(r.read())
        except OSError as e:
            print(f"  {url}: {e}")
    if not path.exists() or _sha256(path) != deb.sha256:
        raise SystemExit(f"could not fetch {deb.filename} with sha256 {deb.sha256}")
    return path


def deb_files(path: Path, root: str, suffix: str) -> dict[str, str]:
    """Regular files under `root` ending in `suffix`, read straight out of the .deb.

    A .deb is an ar archive holding data.tar.*; reading it here spares us dpkg.
    """
    blob = path.read_bytes()
    pos, data = 8, None  # after the "!<arch>\n" magic
    while pos < len(blob):
        name = blob[pos : pos + 16].decode().strip().rstrip("/")
        size = int(blob[pos + 48 : pos + 58].decode())
        if name.startswith("data.tar"):
            data = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)
    if data is None:
        raise SystemExit(f"{path}: no data.tar member")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(root) and member.name.endswith(suffix):
                raw = tar.extractfile(member).read()
                out[member.name.removeprefix(root)] = raw.decode("utf-8", errors="replace")
    return out


# ---------------------------------------------------------------- reST to plain text

# Directives whose whole block is markup for Sphinx, not prose.
DROP = {
    "index", "toctree", "include", "literalinclude", "highlight", "module", "moduleauthor",
    "sectionauthor", "testsetup", "testcleanup", "tabularcolumns", "currentmodule", "program",
    "raw", "only", "image", "figure", "productionlist", "list-table", "csv-table", "rubric",
    "audit-event", "audit-event-table", "availability", "impl-detail", "opcode", "pdbcommand",
}
LITERAL = {"code-block", "code", "sourcecode", "doctest", "testcode", "testoutput"}
LABELS = {
    "note": "Note:",
    "warning": "Warning:",
    "seealso": "See also:",
    "attention": "Attention:",
    "caution": "Caution:",
    "important": "Important:",
    "tip": "Tip:",
    "hint": "Hint:",
    "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}:",
}
# Roles that name code: kept as `name`; other roles keep their plain text.
CODE_ROLES = {
    "mod", "func", "meth", "class", "exc", "attr", "data", "const", "obj", "keyword",
    "c:func", "c:member", "c:type", "c:data", "c:macro", "c:expr", "c:struct", "c:var",
    "py:data", "py:func", "py:class", "py:meth", "opcode", "envvar", "option", "file",
    "program", "command", "samp", "token", "kbd", "mailheader", "mimetype", "pdbcmd",
}

DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
ROLE = re.compile(r":((?:[\w-]+:)?[\w-]+):`((?:[^`\\]|\\.)+)`")
LINK = re.compile(r"`([^`<]+?)\s*<[^`>]*>`__?|`([^`]+)`__?")
RULE = re.compile(r"^\s*([=\-~^\"'*#+`.:_])\1{2,}\s*$")


def _role(m: re.Match) -> str:
    role, text = m.group(1), m.group(2).replace("\\", "")
    if "<" in text and text.endswith(">"):
        text = text[: text.index("<")].strip()
    if text.startswith("~"):
        text = text.rsplit(".", 1)[-1]
    text = text.lstrip("!")
    if role == "pep":
        return f"PEP {text}"
    if role == "rfc":
        return f"RFC {text}"
    if role in ("issue", "gh"):
        return f"{'bpo' if role == 'issue' else 'gh'}-{text}"
    return f"`{text}`" if role in CODE_ROLES else text


def inline(line: str) -> str:
    line = ROLE.sub(_role, line)
    line = LINK.sub(lambda m: m.group(1) or m.group(2), line)
    line = re.sub(r"``(.+?)``", r"`\1`", line)
    line = re.sub(r"\*\*(\S.*?)\*\*", r"\1", line)
    line = re.sub(r"(?<![\w*\\])\*([A-Za-z][^*\n]*?)\*(?![\w*])", r"\1", line)
    line = re.sub(r"\s*\[(#[\w-]*|\d+)\]_", "", line)
    line = line.replace("\\ ", "").replace("\\*", "*")
    if line.rstrip().endswith("::"):
        line = line.rstrip()[:-2].rstrip()
        line = line + ":" if line.strip() else ""
    return line


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_to_text(src: str) -> str:
    """Plain text from Sphinx reST: markup dropped, prose and code examples kept."""
    out: list[str] = []
    lines = src.splitlines()
    skip = literal = None  # indents: drop / keep verbatim the lines indented past them
    i = 0
    while i < len(lines):
        line, i = lines[i], i + 1
        blank = not line.strip()
        if skip is not None:
            if blank or _indent(line) > skip:
                continue
            skip = None
        if literal is not None:
            if blank or _indent(line) > literal:
                out.append(line)
                continue
            literal = None
        if RULE.match(line):
            continue
        m = DIRECTIVE.match(line)
        if m:
            pad, name, arg = m.group(1), m.group(2), m.group(3)
            while arg.endswith("\\") and i < len(lines):
                arg, i = arg[:-1].rstrip() + " " + lines[i].strip(), i + 1
            # Options (`:noindex:`, `:synopsis:`) follow the directive line, indented.
            while i < len(lines) and re.match(rf"\s{{{len(pad) + 1},}}:", lines[i]):
                i += 1
            if name in DROP:
                skip = len(pad)
            elif name in LITERAL:
                literal = len(pad)
            elif name in LABELS:
                label = LABELS[name].format(arg.split()[0] if arg else "").replace(" .", ".")
                rest = " ".join(arg.split()[1:]) if "{}" in LABELS[name] else arg
                out.append(pad + inline(f"{label} {rest}".rstrip()))
            elif arg:
                out.append(pad + inline(arg))  # a signature, a heading, an option name
            continue
        if line.lstrip().startswith(".."):
            skip = _indent(line)  # a comment or a link target, with its continuation
            continue
        if line.rstrip().endswith("::"):
            literal = _indent(line)
        doctest = literal is not None and line.lstrip().startswith(">>>")
        out.append(line.rstrip() if doctest else inline(line))
    text = "\n".join(line.rstrip() for line in out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


# ---------------------------------------------------------------- chat examples

SIGNATURE = re.compile(r"^(\s*)\.\.\s+(function|class|exception|method|classmethod)::\s*(.+)$")
QUESTIONS = [
    "What does `{name}` do?",
    "Explain `{name}`.",
    "How do I use `{name}`?",
    "What is `{name}` for?",
    "Tell me about `{name}` in Python.",
]
SYSTEM = "You are a helpful assistant who knows the Python standard library."


def _stable(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def chat_examples(src: str) -> list[str]:
    """One question and answer per documented callable of a library page."""
    lines = src.splitlines()
    module = ""
    classes: list[tuple[int, str]] = []  # (indent, name) of the enclosing class directives
    examples = []
    for i, line in enumerate(lines):
        m = re.match(r"^\.\.\s+(?:module|currentmodule)::\s*(\S+)", line)
        if m:
            module = m.group(1)
        m = SIGNATURE.match(line)
        if not m or not module:
            continue
        pad, kind, sig = len(m.group(1)), m.group(2), m.group(3)
        j = i + 1
        while sig.endswith("\\") and j < len(lines):
            sig, j = sig[:-1].rstrip() + " " + lines[j].strip(), j + 1
        sig = re.sub(r"\s+", " ", sig)
        name = sig.split("(")[0].strip()
        classes = [(p, c) for p, c in classes if p < pad]  # still enclosing this one
        owner = classes[-1][1] if classes else ""
        if kind in ("class", "exception"):
            classes.append((pad, name))
        if kind in ("method", "classmethod") and owner and "." not in name:
            name = f"{owner}.{name}"
        if not name.startswith(module + "."):
            name = f"{module}.{name}"
        # The first paragraph of the body is the answer.
        while j < len(lines) and (not lines[j].strip() or lines[j].strip().startswith(":")):
            j += 1
        para = []
        while j < len(lines) and lines[j].strip() and _indent(lines[j]) > pad:
            if lines[j].strip().startswith(".."):
                break
            para.append(lines[j].strip())
            j += 1
        answer = re.sub(r"\s+", " ", inline(" ".join(para))).strip()
        if answer.endswith(":"):  # "... for example:" introduced a code block we leave out
            answer = answer[: answer.rfind(". ") + 1]
        if len(answer) < 40:
            continue
        h = _stable(name)
        question = QUESTIONS[h % len(QUESTIONS)].format(name=name)
        messages = [{"role": "user", "content": question}]
        if h % 3 == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        args = sig[sig.index("(") :] if "(" in sig else ""
        display = name + (args if len(args) <= 60 else "(...)")
        messages.append({"role": "assistant", "content": f"`{display}`: {answer}"})
        examples.append(render_chat(messages))
    return examples


# ---------------------------------------------------------------- the corpus


def is_eval(source: str) -> bool:
    return _stable(source) % 100 < EVAL_PERCENT


def documents(debs: list[Path]) -> list[tuple[str, str, str]]:
    """(source file, document key, stream text) for every document, in a fixed order."""
    docs = []
    for path in debs:
        for name, src in sorted(deb_files(path, DOC_ROOT, ".rst.txt").items()):
            source = f"doc/{name.removesuffix('.txt')}"
            text = rst_to_text(src)
            if len(text) > 200:
                docs.append((source, source, f"{BOS}{text}{EOS}"))
            if name.startswith("library/"):
                for k, chat in enumerate(chat_examples(src)):
                    docs.append((source, f"{source}#chat{k}", chat))
        for name, src in sorted(deb_files(path, LIB_ROOT, ".py").items()):
            if name.startswith(LIB_SKIP):
                continue
            if src.strip():
                source = f"lib/{name}"
                docs.append((source, source, f"{BOS}{src.rstrip()}\n{EOS}"))
    # A fixed shuffle (by hash of the key) so any prefix mixes prose, code and chat.
    return sorted(docs, key=lambda d: (_stable(d[1]), d[1]))


def prepare(data: Path) -> Path:
    """Write DATA/corpus/{train,eval}.txt and manifest.json; returns the corpus directory."""
    out = data / "corpus"
    debs = [fetch(deb, data / "debs") for deb in PACKAGES]
    docs = documents(debs)
    split: dict[str, list[str]] = {"train": [], "eval": []}
    kinds: dict[str, dict[str, int]] = {"train": {}, "eval": {}}
    for source, key, text in docs:
        part = "eval" if is_eval(source) else "train"
        split[part].append(text)
        kind = "chat" if "#chat" in key else source.split("/")[0]
        kinds[part][kind] = kinds[part].get(kind, 0) + 1
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"packages": [f"{d.name}={d.version}" for d in PACKAGES]}
    for part, texts in split.items():
        body = "".join(texts)
        (out / f"{part}.txt").write_text(body, encoding="utf-8")
        manifest[part] = {
            "documents": kinds[part],
            "chars": len(body),
            "sha256": hashlib.sha256(body.encode()).hexdigest(),
        }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("data"), help="cache and output directory")
    args = ap.parse_args()
    out = prepare(args.data)
    print((out / "manifest.json").read_text())


if __name__ == "__main__":
    main()

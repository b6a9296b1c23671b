"""lips/prompt_cache.py --schema (Prompt Cache's modules) on a real daemon and the suite's
random test model: a composed prompt equals a tree pred of the same attention pattern and
transformers with that attention mask; modules are computed once and rebuilt when they
change; unions, parameters, page sharing; and bad schemas and prompts (lips/pml.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from daemon import ROOT, SYMPHONY, meminfo

from lips.pml import PMLError, parse_prompt, parse_schema
from lips.prompt_cache import ModuleCache, ensure_cache
from syscalls.client import File

SCHEMA = """<schema name="trip">
  <module name="system">The quick brown fox is a travel guide.</module>
  <union>
    <module name="paris">def paris(n): return n if n &lt; 2 else paris(n - 1)</module>
    <module name="tokyo">The lazy dog jumps over Tokyo.</module>
  </union>
  <module name="plan">Stay <parameter name="days" len="6"/> days for
    <parameter name="who" len="9"/>.</module>
</schema>"""
TRIP = '<prompt><system/><tokyo/><plan days="3" who="the fox"/>Where first?</prompt>'
SAMPLING = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None}


def cache_of(k, text: str = SCHEMA, directory: str = "/tmp/pc") -> ModuleCache:
    cache = ModuleCache(k, parse_schema(text), f"{directory}/{parse_schema(text).name}")
    cache.ensure()
    return cache


def reference(k, cache: ModuleCache, prompt_xml: str, n: int) -> tuple[list[int], list[float]]:
    """The same attention pattern without the cache: the BOS, then every module of the prompt
    as its own branch of one tree pred (each attends to the BOS and to itself), then the
    arguments and question, then greedy decoding, all in one fresh file."""
    prompt = parse_prompt(prompt_xml, cache.schema)
    tokens, positions, parents = cache.as_tree(prompt)
    inputs, at = cache.inputs(prompt)
    with k.open() as f:
        f.pred(cache.root, range(len(cache.root)), no_outputs=True)
        f.pred(tokens, positions, parents=parents, no_outputs=True)
        outs = [f.pred(inputs, at)[0]]
        while len(outs) < n and outs[-1].token not in k.model_info().eos_ids:
            outs += f.pred([outs[-1].token])
    return [o.token for o in outs], [o.logprob for o in outs]


def transformers_logprobs(model, cache: ModuleCache, prompt_xml: str) -> torch.Tensor:
    """The first output token's log-probabilities from Hugging Face transformers on the same
    checkpoint, given the composed prompt's attention pattern as a 4-D mask."""
    from transformers import AutoModelForCausalLM

    prompt = parse_prompt(prompt_xml, cache.schema)
    ids, pos, groups = list(cache.root), list(range(len(cache.root))), [0] * len(cache.root)
    for i, name in enumerate(prompt.modules, start=1):
        ids += cache.placed[name].tokens
        pos += cache.placed[name].positions
        groups += [i] * len(cache.placed[name].tokens)
    inputs, at = cache.inputs(prompt)
    ids, pos, groups = ids + inputs, pos + at, groups + [-1] * len(inputs)
    n = len(ids)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for kv in range(q + 1):  # the BOS and one's own module; the inputs see everything
            allowed[q, kv] = groups[kv] == 0 or groups[q] == -1 or groups[q] == groups[kv]
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager"
    )
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        logits = hf(
            torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=mask
        ).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def run_lip(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*SYMPHONY, "run", "lips/prompt_cache.py", *args],
        env=daemon.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


def lip_json(daemon, schema_path, *prompts: str, cache: str = "pc") -> dict:
    args = ["--schema", str(schema_path), "--cache", cache, "--json", "--max-new-tokens", "6"]
    for p in prompts:
        args += ["--prompt", p]
    lip = run_lip(daemon, *args)
    assert lip.returncode == 0, lip.stderr
    return json.loads(lip.stdout)


def test_a_composed_prompt_equals_a_tree_pred_and_transformers(k, model):
    cache = cache_of(k)
    for xml in (
        TRIP,
        '<prompt><paris/><plan days="12" who=""/>Why?</prompt>',
        "<prompt><system/>Hello</prompt>",
    ):
        got = cache.answer(parse_prompt(xml, cache.schema), 8, SAMPLING)
        tokens, logprobs = reference(k, cache, xml, 8)
        assert got["output_ids"] == tokens
        assert got["logprobs"] == pytest.approx(logprobs, abs=1e-4)
        hf = transformers_logprobs(model, cache, xml)
        assert got["output_ids"][0] == int(hf.argmax())
        assert got["logprobs"][0] == pytest.approx(float(hf[tokens[0]]), abs=1e-4)


def test_one_module_and_a_question_equal_a_contiguous_prefill(k):
    cache = cache_of(
        k, '<schema name="one"><module name="doc">def fibonacci(n): return n</module></schema>'
    )
    got = cache.answer(parse_prompt("<prompt><doc/>fibonacci(</prompt>", cache.schema), 8, SAMPLING)
    text = cache.root + cache.placed["doc"].tokens + got["input_ids"]
    assert got["positions"][0] == len(text) - len(got["input_ids"])  # no gap before it
    with k.open() as f:
        outs = [f.pred(text)[0]]
        while len(outs) < 8 and outs[-1].token not in k.model_info().eos_ids:
            outs += f.pred([outs[-1].token])
    assert got["output_ids"] == [o.token for o in outs]
    assert got["logprobs"] == pytest.approx([o.logprob for o in outs], abs=1e-4)


def test_modules_are_computed_once_and_rebuilt_when_they_change(daemon, k, tmp_path):
    schema = tmp_path / "trip.xml"
    schema.write_text(SCHEMA)
    first = lip_json(daemon, schema, TRIP, "<prompt><paris/>Why?</prompt>")
    directory = first["directory"]
    assert directory == f"{k.home}/pc/trip" and first["removed"] == []
    names = sorted(first["built"])
    assert [n.split(".")[0] for n in names] == ["", "paris", "plan", "system", "tokyo"]
    inodes = {n: k.stat(f"{directory}/{n}").ino for n in names}

    def asked(run: dict) -> int:  # what the prompts computed: inputs, then one pred a token
        return sum(a["input_tokens"] + len(a["output_ids"]) - 1 for a in run["answers"])

    base = k.stat(f"{directory}/{names[0]}").tokens  # the BOS and its padding: one page
    built = base + sum(k.stat(f"{directory}/{n}").tokens - base for n in names[1:])
    assert first["computed_tokens"] == asked(first) + built
    again = lip_json(daemon, schema, TRIP, "<prompt><paris/>Why?</prompt>")
    assert again["built"] == again["dropped"] == {} and again["removed"] == []
    assert again["computed_tokens"] == asked(again)  # no module computed again
    assert {n: k.stat(f"{directory}/{n}").ino for n in names} == inodes
    assert [a["output_ids"] for a in again["answers"]] == [
        a["output_ids"] for a in first["answers"]
    ]

    schema.write_text(SCHEMA.replace("days for", "days with"))  # the last module
    changed = lip_json(daemon, schema, TRIP)
    assert [n.split(".")[0] for n in changed["built"]] == ["plan"]
    assert changed["removed"] == [n for n in names if n.startswith("plan.")]
    schema.write_text(SCHEMA.replace("travel guide", "guide"))  # shorter: later modules move
    moved = lip_json(daemon, schema, TRIP)
    assert sorted(n.split(".")[0] for n in moved["built"]) == ["paris", "plan", "system", "tokyo"]
    assert len(moved["removed"]) == 4
    assert sorted(n for n, _ in k.readdir(directory)) == sorted([names[0], *moved["built"]])


def test_a_module_another_run_linked_first_is_reported_dropped(
    daemon, k, tmp_path, lip_main, monkeypatch
):
    """Two runs that build one missing module at once each compute it; the one whose link
    comes second drops its copy. It reported `"built": {}` and no line for it, though its
    computed_tokens counted the module: now it lists it under `dropped`. The race is made
    certain: another session builds the module between this run's pred and its link (the
    client's link, wrapped)."""
    schema = tmp_path / "trip.xml"
    schema.write_text(SCHEMA)
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    link, raced = File.link, []

    def racing(self: File, path: str) -> None:
        directory, name = path.rsplit("/", 1)
        if name.startswith("tokyo.") and not raced:
            raced.append(name)
            assert name in ModuleCache(k, parse_schema(SCHEMA), directory).ensure()["built"]
        link(self, path)

    monkeypatch.setattr(File, "link", racing)
    argv = ["--schema", str(schema), "--cache", "race", "--max-new-tokens", "6", "--prompt"]
    code, out, err = lip_main("prompt_cache", *argv, TRIP, "--json")
    assert code == 0, err
    run = json.loads(out)
    directory = run["directory"]
    assert sorted(n.split(".")[0] for n in run["built"]) == ["", "paris", "system"]
    assert list(run["dropped"]) == raced and run["dropped"][raced[0]] > 0
    base = k.stat(f"{directory}/{next(n for n in run['built'] if n.startswith('.'))}").tokens
    computed = base + sum(  # each module's entries after the BOS page, the BOS file's own
        k.stat(f"{directory}/{n}").tokens - base
        for n in [*run["built"], *run["dropped"]]
        if not n.startswith(".")
    )
    (a,) = run["answers"]
    assert run["computed_tokens"] == a["input_tokens"] + len(a["output_ids"]) - 1 + computed

    k.unlink(f"{directory}/{raced.pop()}")  # again, in text: a line for the dropped copy
    code, out, err = lip_main("prompt_cache", *argv, TRIP)
    assert code == 0, err
    assert out.startswith(
        f"dropped {directory}/{raced[0]}, computed in "
    ) and " s: another run linked it first\n" in out
    assert "built" not in out


def test_a_document_another_run_named_first_is_reported_dropped(
    daemon, k, tmp_path, lip_main, monkeypatch
):
    """--document: the run whose link comes second computed the whole document, yet said
    `"built": false` and `"build_seconds": 0`, as if it had found the file; now `dropped`
    and its seconds. The race made certain as above."""
    doc = tmp_path / "doc.txt"
    doc.write_text("A document about the sea, and the ships on it. " * 8)
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    link, raced = File.link, []

    def racing(self: File, path: str) -> None:
        if path.endswith("/race-doc.kv") and not raced:
            raced.append(path)
            assert ensure_cache(k, path, k.tokenize(doc.read_text(), add_special=True)) == (
                "built")
        link(self, path)

    monkeypatch.setattr(File, "link", racing)
    argv = ["--document", str(doc), "--cache", "race-doc.kv", "--question", "Ships?",
            "--max-new-tokens", "2", "--json"]
    code, out, err = lip_main("prompt_cache", *argv)
    assert code == 0, err
    run = json.loads(out)
    assert (run["built"], run["dropped"]) == (False, True) and run["build_seconds"] > 0
    code, out, err = lip_main("prompt_cache", *argv)  # found there: neither
    run = json.loads(out)
    assert (run["built"], run["dropped"], run["build_seconds"]) == (False, False, 0.0)
    k.unlink(raced[0])


def test_a_union_shares_one_range_and_a_prompt_picks_one(daemon, k, tmp_path):
    cache = cache_of(k)
    paris, tokyo = cache.placed["paris"], cache.placed["tokyo"]
    assert paris.positions[0] == tokyo.positions[0] == cache.placed["system"].positions[-1] + 1
    plan = cache.placed["plan"]
    assert plan.positions[0] == 1 + max(paris.positions[-1], tokyo.positions[-1])
    assert [n for n in cache.placed] == ["system", "paris", "tokyo", "plan"]
    schema = tmp_path / "trip.xml"
    schema.write_text(SCHEMA)
    both = run_lip(
        daemon, "--schema", str(schema), "--prompt", "<prompt><paris/><tokyo/>Which?</prompt>"
    )
    assert both.returncode == 2
    assert "<paris> and <tokyo> are of one union: use one" in both.stderr


def test_parameters_are_filled_at_their_slots_with_gaps(daemon, k, tmp_path):
    cache = cache_of(k)
    prompt = parse_prompt(TRIP, cache.schema)
    inputs, positions = cache.inputs(prompt)
    days, who = k.tokenize("3"), k.tokenize("the fox")
    slots = cache.placed["plan"].slots
    question = k.tokenize("Where first?")
    assert inputs == days + who + question
    assert positions == [
        *slots["days"][: len(days)],
        *slots["who"][: len(who)],
        *range(cache.end, cache.end + len(question)),
    ]
    assert len(slots["days"]) == 6 and slots["who"].start == slots["days"].stop + len(
        k.tokenize(" days for\n    ")
    )
    schema = tmp_path / "trip.xml"
    schema.write_text(SCHEMA)
    long = run_lip(
        daemon,
        "--schema",
        str(schema),
        "--prompt",
        '<prompt><plan days="many many many days" who="x"/>Go</prompt>',
    )
    assert long.returncode == 1
    assert "<plan days=...> is" in long.stderr and "the parameter holds 6" in long.stderr
    missing = run_lip(
        daemon, "--schema", str(schema), "--prompt", '<prompt><plan days="3"/>Go</prompt>'
    )
    assert missing.returncode == 2 and '<plan> needs who="..."' in missing.stderr


def test_a_composed_prompt_shares_every_module_page(k):
    cache = cache_of(k)
    prompt = parse_prompt(TRIP, cache.schema)
    page = cache.page_size
    files = [f"{cache.directory}/{cache.placed[n].file}" for n in prompt.modules]
    module_pages = sum(k.stat(f).pages - 1 for f in files)  # each but its BOS page
    assert all(k.stat(f).tokens % page == 0 for f in files)  # padded to page boundaries
    before = int(meminfo(k)["device_used"])
    with cache.compose(prompt) as f:
        assert k.stat(f).pages == 1 + module_pages
        assert int(meminfo(k)["device_used"]) == before  # shared, not one row copied
        tokens, positions = k.read(f)
        assert positions[:1] == [0] and len(tokens) == page * (1 + module_pages)
        inputs, at = cache.inputs(prompt)
        f.pred(inputs, at, no_outputs=True)  # nothing decoded ahead into a page
        assert int(meminfo(k)["device_used"]) == before + -(-len(inputs) // page)
    assert int(meminfo(k)["device_used"]) == before


@pytest.mark.parametrize(
    "schema, message",
    [
        ("<schema name='s'><module name='a'>x", "schema: not well-formed XML"),
        ("<schemas name='s'/>", "the root element is <schemas>, not <schema>"),
        ("<schema><module name='a'>x</module></schema>", "schema: <schema> has no name"),
        ("<schema name='s'><modul name='a'>x</modul></schema>", "schema: <modul>"),
        ("<schema name='s'><module name='a b'>x</module></schema>", "name='a b'>: a name must"),
        (
            "<schema name='s'><module name='a'>x</module><module name='a'>y</module></schema>",
            "module 'a' declared twice",
        ),
        (
            "<schema name='s'><module name='a'>x<module name='b'>y</module></module></schema>",
            "module 'a': <module> inside a module",
        ),
        (
            "<schema name='s'><module name='a'>x<parameter name='p'/></module></schema>",
            "module 'a': <parameter name='p'> needs len",
        ),
        (
            "<schema name='s'><module name='a'>x<parameter name='p' len='0'/></module></schema>",
            "needs len, a whole number of tokens >= 1 (got '0')",
        ),
        ("<schema name='s'><module name='a'>  </module></schema>", "module 'a' is empty"),
        (
            "<schema name='s'><union><parameter name='p' len='2'/></union></schema>",
            "<union> #1 holds <parameter>",
        ),
        (
            "<schema name='s'><union>text<module name='a'>x</module></union></schema>",
            "<union> #1 holds text outside its modules",
        ),
        ("<schema name='s'>loose<module name='a'>x</module></schema>", "text outside a module"),
        ("<schema name='s'></schema>", "schema 's' declares no module"),
    ],
)
def test_a_bad_schema_is_refused_naming_the_element(schema, message):
    with pytest.raises(PMLError) as e:
        parse_schema(schema)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("<prompt><rome/>Hi</prompt>", "<rome> is not a module of schema 'trip'"),
        ("<prompt schema='other'><system/>Hi</prompt>", "it is for schema 'other', not 'trip'"),
        ("<prompt>Hi<system/>there</prompt>", "text before a module"),
        ("<prompt><system/></prompt>", "no question after the modules"),
        ("<prompt><system/><system/>Hi</prompt>", "<system> twice"),
        ("<prompt><system>x</system>Hi</prompt>", "<system> must be empty"),
        ("<prompt><system lang='fr'/>Hi</prompt>", "<system> has unknown attribute 'lang'"),
    ],
)
def test_a_bad_prompt_is_refused_naming_the_element(prompt, message):
    with pytest.raises(PMLError) as e:
        parse_prompt(prompt, parse_schema(SCHEMA))
    assert message in str(e.value)


def without_kernel(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """lips/prompt_cache.py run with `args` and no kernel at its socket."""
    return subprocess.run(
        [sys.executable, "lips/prompt_cache.py", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=60, env={**os.environ, "SYMPHONY_SOCKET": str(tmp_path / "none")})


def test_a_bad_schema_file_exits_2_before_the_kernel_is_asked(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<schema name='s'><module name='a'>x<parameter name='p'/></module></schema>")
    out = without_kernel(tmp_path, "--schema", str(bad), "--prompt", "<prompt>Hi</prompt>")
    assert out.returncode == 2
    assert "module 'a': <parameter name='p'> needs len" in out.stderr


def test_a_missing_document_exits_2_naming_the_flag(tmp_path):
    """--document of no file was `prompt_cache: ...`, exit 1, once the kernel was asked; the
    other file flags (--schema, --prompt-file) are usage errors."""
    from lips import prompt_cache

    missing = str(tmp_path / "nonexistent")
    out = without_kernel(tmp_path, "--document", missing, "--cache", "x.kv", "--question", "q")
    assert out.returncode == 2
    assert f"argument --document: {missing}: No such file or directory" in out.stderr
    args = prompt_cache.build_parser().parse_args(
        ["--document", __file__, "--cache", "x.kv", "--question", "q"])
    assert args.document == open(__file__).read()  # the flag gives the document's text


def test_a_document_without_a_question_exits_2_before_the_kernel_is_asked(tmp_path):
    """It was `no question: ...`, status 1, once the kernel was asked."""
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.\n")
    out = without_kernel(tmp_path, "--document", str(doc), "--cache", "d5.kv")
    assert (out.returncode, out.stdout) == (2, "")
    assert "prompt_cache: error: --document needs a --question or --question-file" in out.stderr

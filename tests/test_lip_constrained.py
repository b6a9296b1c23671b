"""lips/constrained.py on a real daemon: every output conforms, checked another way.

The test model has random weights, so its outputs are gibberish, but gibberish that must
parse and validate: JSON outputs against a small validator of the schema subset used here
(jsonschema is not a dependency), regular-expression outputs against Python's `re`. Greedy
outputs are also checked token by token: each is the model's most likely token among those
the grammar allows, from an unmasked pred's full distribution.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from typing import Any

import llguidance
import pytest
from daemon import ROOT, run_reader_gone

from lips import constrained
from syscalls.context import Context

SYMPHONY = [sys.executable, "-m", "symphony.cli"]
MAX_NEW = 96
SEEDS = (0, 1, 2)
PROMPT = [1, 40, 41, 42, 43]

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -50, "maximum": 50},
        "minItems": 1,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"enum": [1, 2, 3, None]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -1, "maximum": 1},
            "n": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9999},
        },
        "required": ["x", "n"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{1,3}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
    "objects_in_arrays": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["id", "tags"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
}
REGEXES = {"phone": r"[0-9]{3}-[0-9]{4}", "words": r"(yes|no|maybe)( [a-z]{1,5}){0,3}\."}

TYPES = {
    "object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
    "integer": int, "number": (int, float),
}


def violations(value: Any, schema: dict, where: str = "$") -> list[str]:
    """Where `value` breaks `schema` (the subset SCHEMAS uses); [] if it conforms."""
    bad = []
    kind = schema.get("type")
    if kind is not None:
        is_bool = isinstance(value, bool)
        if not isinstance(value, TYPES[kind]) or (is_bool and kind not in ("boolean",)):
            return [f"{where}: {value!r} is not {kind}"]
    if "enum" in schema and not any(value == e and type(value) is type(e)
                                    for e in schema["enum"]):
        bad.append(f"{where}: {value!r} not in {schema['enum']}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            bad.append(f"{where}: {value!r} is not finite")
        if "minimum" in schema and value < schema["minimum"]:
            bad.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            bad.append(f"{where}: {value} > {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            bad.append(f"{where}: {value} <= {schema['exclusiveMinimum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1e9):
            bad.append(f"{where}: length {len(value)} of {value!r}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            bad.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9):
            bad.append(f"{where}: {len(value)} items")
        for i, item in enumerate(value):
            bad += violations(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        bad += [f"{where}: no {name!r}" for name in schema.get("required", ()) if name not in value]
        for name, item in value.items():
            if name in props:
                bad += violations(item, props[name], f"{where}.{name}")
            elif schema.get("additionalProperties", True) is False:
                bad.append(f"{where}: extra {name!r}")
    return bad


def test_the_validator_sees_violations():
    s = SCHEMAS["nested"]
    assert violations({"user": {"name": "ab", "age": 3}, "active": True}, s) == []
    assert violations({"user": {"name": "", "age": 121}, "active": 1}, s) == [
        "$.user.name: length 0 of ''", "$.user.age: 121 > 120", "$.active: 1 is not boolean"]
    assert violations({"user": {"name": "a", "age": 1}, "active": True, "x": 0}, s) == [
        "$: extra 'x'"]
    assert violations({"date": "2024-1-01", "code": "AB1"}, SCHEMAS["patterns"]) != []
    assert violations({"color": "red", "size": True}, SCHEMAS["enums"]) != []
    assert violations([], SCHEMAS["array"]) == ["$: 0 items"]


def conforms(kind: str, name: str, text: str) -> list[str]:
    if kind == "regex":
        return [] if re.fullmatch(REGEXES[name], text) else [f"{text!r} !~ {REGEXES[name]}"]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"{text!r}: not JSON ({e})"]
    return violations(value, SCHEMAS[name])


GRAMMARS = [("schema", n) for n in SCHEMAS] + [("regex", n) for n in REGEXES]


def grammar_of(kind: str, name: str) -> str:
    if kind == "schema":
        return constrained.schema_grammar(SCHEMAS[name])
    return constrained.regex_grammar(REGEXES[name])


@pytest.fixture(scope="module")
def outputs(daemon) -> dict[tuple[str, str, int | None], constrained.Output]:
    """Every grammar, greedy (seed None) and sampled at temperature 1 with each seed (and
    seed 0 twice, for reproducibility), and greedy with fast-forward (key "ff"), decoded
    concurrently: one session, a thread each."""
    results, errors = {}, []
    with daemon.connect("constrained-test") as k:
        vocab, info = k.vocab(), k.model_info()
        tokenizer = constrained.grammar_tokenizer(vocab, info)
        model_split = constrained.grammar_tokenizer(vocab, info, k.tokenize)
        eos = k.model_info().eos_ids

        def one(kind: str, name: str, seed: int | None, key: tuple) -> None:
            try:
                ff = key[0] == "ff"
                m = constrained.matcher(model_split if ff else tokenizer, grammar_of(kind, name))
                sampling = {"temperature": 0.0 if seed is None else 1.0, "seed": seed}
                with Context(k, stop=eos) as ctx:
                    ctx.fill(PROMPT)
                    results[key] = constrained.decode(ctx, m, MAX_NEW,
                                                      sampling, eos, fast_forward=ff)
            except Exception as e:  # reported below, with the job
                errors.append((key, repr(e)))

        jobs = [(kind, name, seed, (kind, name, seed)) for kind, name in GRAMMARS
                for seed in (None, *SEEDS)]
        jobs += [(kind, name, None, ("ff", kind, name)) for kind, name in GRAMMARS]
        jobs.append(("schema", "nested", 0, ("again", "nested", 0)))
        threads = [threading.Thread(target=one, args=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        results["tokenizer"] = tokenizer
    assert errors == []
    return results


def text_of(outputs, out: constrained.Output) -> str:
    return outputs["tokenizer"].decode_bytes(out.tokens).decode()


@pytest.mark.parametrize(("kind", "name"), GRAMMARS)
def test_every_output_conforms_greedy_and_sampled(outputs, kind, name):
    texts = set()
    for seed in (None, *SEEDS):
        out = outputs[(kind, name, seed)]
        text = text_of(outputs, out)
        assert out.complete, (seed, text)
        assert conforms(kind, name, text) == [], (seed, text)
        texts.add(text)
    assert len(texts) > 1  # sampling does vary the output


@pytest.mark.parametrize(("kind", "name"), GRAMMARS)
def test_fast_forward_conforms_in_fewer_preds(outputs, kind, name):
    out = outputs[("ff", kind, name)]
    text = text_of(outputs, out)
    assert out.complete and conforms(kind, name, text) == [], text
    plain = outputs[(kind, name, None)]
    assert plain.preds >= len(plain.tokens)  # one pred a token, and maybe an EOS
    if kind == "schema":  # keys and punctuation are forced
        assert out.preds < len(out.tokens) * 0.8, (out.preds, len(out.tokens))


def test_a_seed_gives_the_same_output_again(outputs):
    assert outputs[("again", "nested", 0)].tokens == outputs[("schema", "nested", 0)].tokens


@pytest.mark.parametrize(("kind", "name"), [("schema", "nested"), ("schema", "patterns"),
                                            ("regex", "words")])
def test_greedy_takes_the_most_likely_allowed_token(daemon, outputs, kind, name):
    """The reference: one unmasked pred over prompt + output gives the model's whole
    distribution at every step; a fresh matcher gives the allowed set; greedy must have
    taken the allowed argmax each time."""
    tokenizer = outputs["tokenizer"]
    out = outputs[(kind, name, None)].tokens
    vocab = tokenizer.vocab_size
    with daemon.connect() as k, k.open() as f:
        f.pred(PROMPT[:-1], no_outputs=True)
        rows = f.pred([PROMPT[-1], *out], outputs=range(len(out) + 1), top_logprobs=vocab)
        eos = set(k.model_info().eos_ids)
    m = constrained.matcher(tokenizer, grammar_of(kind, name))
    for i, row in enumerate(rows):
        mask = m.compute_bitmask()
        allowed = {t for t in range(vocab) if mask[t // 8] >> (t % 8) & 1}
        best = max((lp, t) for t, lp in row.top if t in allowed)[1]
        if i == len(out):  # after the last token: the grammar may end, or had to
            assert best in eos or m.is_stopped()
            break
        assert out[i] == best, i
        assert m.consume_token(out[i])


def lip(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SYMPHONY, "run", "lips/constrained.py", *args], env=daemon.env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_command_line_text_and_json(daemon, outputs, tmp_path):
    schema = tmp_path / "nested.json"
    schema.write_text(json.dumps(SCHEMAS["nested"]))
    ids = ",".join(map(str, PROMPT))
    text = lip(daemon, "--prompt-ids", ids, "--schema", str(schema),
               "--max-new-tokens", str(MAX_NEW))
    assert text.returncode == 0, text.stderr
    assert text.stdout == text_of(outputs, outputs[("schema", "nested", None)]) + "\n"
    js = lip(daemon, "--prompt-ids", ids, "--regex", REGEXES["words"], "--json",
             "--temperature", "1", "--seed", "1")
    assert js.returncode == 0, js.stderr
    got = json.loads(js.stdout)
    assert got["output_ids"] == outputs[("regex", "words", 1)].tokens
    assert got["complete"] is True and got["prompt_ids"] == PROMPT
    assert re.fullmatch(REGEXES["words"], got["text"])
    assert got["matcher_us"] > 0 and got["pred_us"] > 0
    ff = lip(daemon, "--prompt-ids", ids, "--schema", str(schema), "--fast-forward", "--json")
    assert ff.returncode == 0, ff.stderr
    got = json.loads(ff.stdout)
    assert got["output_ids"] == outputs[("ff", "schema", "nested")].tokens
    assert got["preds"] < len(got["output_ids"])


def main(capsys, *argv: str) -> tuple[int, str, str]:
    """constrained.main in this process (no interpreter to start): status, stdout, stderr."""
    try:
        code = constrained.main(list(argv))
    except SystemExit as e:  # argparse's exit
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_running_out_of_tokens_says_incomplete(daemon, capsys, monkeypatch):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    code, out, err = main(capsys, "--prompt-ids", "1,2", "--regex", "[a-z]{40}",
                          "--max-new-tokens", "3")
    assert code == 3
    assert "incomplete" in err and "--max-new-tokens 3" in err
    assert re.fullmatch("[a-z]+\n", out)


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"abc[^\s\S]", r"a[^\s\S]|b[^\s\S]"])
def test_a_grammar_that_allows_nothing_is_never_complete(k, regex):
    """A grammar past the flag's check that allows no token (not even EOS) is a dead end:
    the output is incomplete, never reported as conforming."""
    info = k.model_info()
    tokenizer = constrained.grammar_tokenizer(k.vocab(), info)
    m = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_regex(regex),
                             log_level=0)
    with Context(k, stop=info.eos_ids) as ctx:
        ctx.fill(PROMPT)
        out = constrained.decode(ctx, m, 8, {"temperature": 0.0}, info.eos_ids)
    assert not out.complete and out.tokens == []


@pytest.mark.parametrize(("flags", "message"), [
    (["--regex", "a(b"], "argument --regex: bad regex"),
    (["--regex", r"\bword"], "argument --regex: bad regex"),
    (["--regex", r"[^\s\S]"], "argument --regex: bad regex: it matches no string"),
    (["--regex", r"abc[^\s\S]"], "argument --regex: bad regex: it matches no string"),
    (["--schema", '{"type": "foo"}'], "argument --schema: bad schema: Invalid type: foo"),
    (["--schema", '{"type": "integer", "minimum": 5, "maximum": 2}'], "Unsatisfiable"),
    (["--schema", '{"type": '], "argument --schema: not JSON"),
    (["--schema", "/nonexistent/schema.json"], "No such file or directory"),
    (["--schema", "[1, 2]"], "[1, 2]: No such file"),
    (["--schema", "{}", "--regex", "a"], "not allowed with argument"),
    ([], "one of the arguments --schema --regex is required"),
])
def test_bad_grammars_and_flags_exit_2_with_a_message(capsys, flags, message):
    code, out, err = main(capsys, "--prompt-ids", "1,2", *flags)
    assert code == 2 and out == ""
    assert "constrained: error: " in err and message in err


def test_no_kernel_is_reported(tmp_path):
    r = subprocess.run([sys.executable, "lips/constrained.py", "--prompt-ids", "1",
                        "--regex", "a"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SYMPHONY_SOCKET": str(tmp_path / "none.sock")})
    assert r.returncode == 1
    assert r.stderr.startswith("constrained: ") and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [
    ["--help"],
    ["--prompt-ids", "1,2", "--regex", "[a-z]{4}", "--max-new-tokens", "8"],
    ["--prompt-ids", "1,2", "--regex", "[a-z]{4}", "--max-new-tokens", "8", "--json"],
])
def test_a_reader_gone_from_stdout_stops_it_quietly(daemon, args):
    """`constrained ... | head -1`: --help's write was a traceback, and output still waiting
    at exit Python's "Exception ignored ... BrokenPipeError", status 120; now nothing, 141
    (128 + SIGPIPE), as every lip_main LIP."""
    # stdout buffered, as a user's is (PYTHONUNBUFFERED would write each print at once)
    env = {k: v for k, v in daemon.env().items() if k != "PYTHONUNBUFFERED"}
    out = run_reader_gone([sys.executable, "lips/constrained.py", *args], env)
    assert (out.returncode, out.stderr) == (141, "")

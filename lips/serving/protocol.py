"""OpenAI's HTTP protocol: the request bodies (parsed and checked), and the response, chunk
and error shapes.

A field the server does not know is a 400 naming it, as OpenAI's server answers
("Unrecognized request argument supplied: NAME"); a field of OpenAI's that changes nothing
here (user, store, metadata...) is declared with its type and taken; a field it knows but
does not implement (tools, suffix, audio...) is a 400 naming it, never ignored silently.
Nothing here talks to the kernel: the program (lips/openai_server.py) tokenizes and hands
the checked request to the Generator as GenParams.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from lips.constrained import GrammarError, schema_grammar
from lips.serving.errors import ApiError, bad_field
from lips.serving.generation import Batch, Delta, GenParams, TokenLogprob, Usage

MAX_STOP = 4  # stop strings, as OpenAI
MAX_LOGPROBS = 20
MAX_PROMPTS = 2048  # prompts in one completions request, as OpenAI's
# Choices of one request, prompts times n: all are started at once, each a generation with a
# file of its own; OpenAI's bounds alone (2048 prompts, n 128) allow 262144.
MAX_CHOICES = 2048


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    if not all(0 <= t < vocab_size for t in ids):
        raise bad_field(field, f"token ids must be in 0..{vocab_size - 1}")


def _unencodable(value: Any) -> str | None:
    """The path of the first string in `value` that is not valid Unicode text (JSON lets a
    lone surrogate such as "\\ud800" through; UTF-8 cannot carry it), or None. A walk with
    its own stack: JSON may nest deeper than Python's recursion."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode()
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            stack.extend(reversed([(f"{path}.{k}" if path else str(k), x) for k, x in v.items()]))
        elif isinstance(v, list):
            stack.extend(reversed([(f"{path}[{i}]", x) for i, x in enumerate(v)]))
    return None


class Body(BaseModel):
    """A request body: an unknown field a 400 (extra_forbidden, which the server words as
    OpenAI's), a known field's null taken as left out (clients send null for "the
    default"), and text that is not valid Unicode a 400 naming its field. Types are strict,
    as OpenAI's: a value of another JSON type is a 400 naming its field (pydantic's lax
    mode took "3" and true as the integers 3 and 1, 2.0 as 2, "yes" as true), but for a
    JSON integer where a number is expected (temperature: 1). A number must be finite: the
    JSON parser takes NaN and Infinity, which are a 400 saying so."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if (bad := _unencodable(data)) is not None:
            raise bad_field(bad, "not valid Unicode text (a lone surrogate)")
        if isinstance(data, dict):
            known = {f.alias or name for name, f in cls.model_fields.items()}
            return {k: v for k, v in data.items() if v is not None or k not in known}
        return data


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks: none here


class SamplingRequest(Body):
    """The fields both endpoints share; the defaults are OpenAI's."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, ge=0, le=1)  # 0: the most likely token only (OpenAI's)
    top_k: int = Field(0, ge=-1, le=2**31 - 1)  # vLLM extra; -1 or 0: no limit
    min_p: float = Field(0.0, ge=0, le=1)  # vLLM extra
    n: int = Field(1, ge=1, le=128)
    stop: Any = ()  # a string or a list of them, as a tuple (Any: errors name "stop")
    # pred's seed, a signed 64-bit integer (a wider one was folded onto these modulo 2**64);
    # torch's generator reads its 64 bits unsigned, -1 as 2**64 - 1.
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM extra
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # OpenAI's end-user id: changes nothing here

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else stop or []
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("a string or a list of strings")
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if not all(stops):
            raise ValueError("a stop sequence must not be empty")
        return tuple(stops)

    def check(self, vocab_size: int) -> None:
        """What needs more than one field, or the model, to check."""
        if self.top_k > vocab_size:
            raise bad_field("top_k", f"must be at most the vocabulary's {vocab_size} tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise bad_field(name, "not supported by this server (only 0)")
        if self.stream_options is not None and not self.stream:
            raise bad_field("stream_options", "only allowed when stream is true")
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= vocab_size:
                raise bad_field("logit_bias", f"{key!r} is not a token id of this model "
                                f"(0..{vocab_size - 1})")
            if not -100 <= value <= 100:
                shown = int(value) if value.is_integer() else value  # 101, not 101.0
                raise bad_field("logit_bias", f"token {key}'s bias {shown} is not in "
                                "[-100, 100]")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> dict[str, Any]:
        """GenParams' sampling fields. top_p 0 is OpenAI's nucleus of mass 0, the most
        likely token alone: top_k 1 on the kernel's sampler (whose top_p 0 means no limit)."""
        nucleus = self.top_p == 0
        return {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": 1.0 if nucleus else self.top_p,
            "top_k": 1 if nucleus else max(self.top_k, 0),
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "logit_bias": ({int(k): v for k, v in self.logit_bias.items()}
                           if self.logit_bias else None),
        }


SHAPES = "a string, an array of strings, an array of token ids, or an array of token-id arrays"


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt` is parsed into a list of prompts, each text or token
    ids: OpenAI's four shapes (a string, an array of strings, an array of token ids, an
    array of token-id arrays)."""

    prompt: Any
    max_tokens: int = Field(16, ge=0)  # 0: no new token (the echoed prompt's logprobs)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM extra: a text prompt's BOS and the like
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> list[str | list[int]]:
        """The prompts, each a non-empty string or non-empty list of token ids."""
        single = isinstance(prompt, str) or (_is_ids(prompt) and prompt)
        prompts = [prompt] if single else prompt
        if not isinstance(prompts, list) or not prompts:
            raise ValueError(SHAPES)
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        if not (all(isinstance(p, str) for p in prompts) or all(_is_ids(p) for p in prompts)):
            raise ValueError(f"{SHAPES}: all prompts text or all token ids")
        for i, p in enumerate(prompts):
            if not p:
                if len(prompts) == 1:
                    raise ValueError("the prompt is empty")
                raise bad_field(f"prompt[{i}]", "the prompt is empty")
        return prompts

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        if self.suffix:
            raise bad_field("suffix", "not supported by this server")
        if self.best_of not in (None, 1):
            raise bad_field("best_of", "not supported by this server (only 1)")
        if len(self.prompt) * self.n > MAX_CHOICES:
            raise bad_field("n", f"{len(self.prompt)} prompts with n {self.n} ask for "
                            f"{len(self.prompt) * self.n} choices; at most {MAX_CHOICES} in one "
                            "request")
        for i, p in enumerate(self.prompt):
            if isinstance(p, list):
                check_token_ids(p, vocab_size, self.where(i))

    def where(self, i: int) -> str:
        """Prompt i's name in an error: `prompt`, or `prompt[i]` in a batch."""
        return "prompt" if len(self.prompt) == 1 else f"prompt[{i}]"

    def params(self, prompt: list[int], max_tokens: int) -> GenParams:
        return GenParams(prompt=prompt, max_tokens=max_tokens, logprobs=self.logprobs,
                         prompt_logprobs=self.echo and self.logprobs is not None,
                         **self.sampling())


class Message(Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None  # a string or a list of text parts (Any: errors name the field)
    name: str | None = None  # a participant's name: not given to the chat template
    refusal: str | None = None  # an assistant's refusal, as OpenAI's: changes nothing here
    tool_calls: Any = None
    function_call: Any = None

    def text(self, where: str) -> str:
        """The content as one string: text parts joined; other parts are a 400."""
        for name in ("tool_calls", "function_call"):
            if getattr(self, name) is not None:
                raise bad_field(f"{where}.{name}", "tool calls are not supported by this server")
        if self.content is None:
            if self.role != "assistant":
                raise bad_field(f"{where}.content", "a message needs content")
            return ""
        if isinstance(self.content, str):
            return self.content
        if not isinstance(self.content, list):
            raise bad_field(f"{where}.content", "a string or a list of content parts")
        if not self.content:  # OpenAI's refuses an empty array too
            raise bad_field(f"{where}.content", "a message needs content (an empty array of "
                            "content parts)")
        texts = []
        for i, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise bad_field(f"{where}.content[{i}]", f"only text parts are supported, "
                                f"not {kind!r}")
            if "text" not in part:
                raise bad_field(f"{where}.content[{i}]", "a text part needs its text (the "
                                "part has no \"text\")")
            if not isinstance(part["text"], str):
                raise bad_field(f"{where}.content[{i}].text", "must be a string")
            texts.append(part["text"])
        return "".join(texts)


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as the chat template takes them. OpenAI's "developer" role is its newer
    name for "system", which is what templates know."""
    return [{"role": "system" if m.role == "developer" else m.role,
             "content": m.text(f"messages[{i}]")} for i, m in enumerate(messages)]


# json_schema without its `schema` (OpenAI's is optional): a JSON object, as json_object
# gives; OpenAI's structured output is always an object, and clients read it as one.
ANY_OBJECT = {"type": "object"}


class JsonSchema(Body):
    """response_format.json_schema: its name, description and `strict` change nothing here
    (the output always conforms)."""

    schema_: Any = Field(None, alias="schema")
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def grammar(self) -> str | None:
        """The llguidance grammar that keeps the output in this format; None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return schema_grammar(ANY_OBJECT)
        if self.json_schema is None:
            raise bad_field("response_format.json_schema", "required when type is json_schema")
        schema = self.json_schema.schema_
        try:
            return schema_grammar(ANY_OBJECT if schema is None else schema)
        except GrammarError as e:
            raise bad_field("response_format.json_schema.schema", str(e)) from e


class ChatRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    add_special_tokens: bool = False  # vLLM extra: BOS and the like on top of the template
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # OpenAI's fields that change nothing here, type-checked and taken
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def check(self, vocab_size: int) -> None:
        super().check(vocab_size)
        for name in ("tools", "functions"):
            if getattr(self, name) not in (None, []):  # an empty list of tools asks nothing
                raise bad_field(name, "not supported by this server")
        for name in ("function_call", "audio", "prediction", "reasoning_effort", "verbosity",
                     "web_search_options"):
            if getattr(self, name) is not None:
                raise bad_field(name, "not supported by this server")
        if self.tool_choice not in (None, "none"):
            raise bad_field("tool_choice", "not supported by this server (only \"none\")")
        if self.modalities not in (None, ["text"]):
            raise bad_field("modalities", "only [\"text\"] is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_field("top_logprobs", "needs logprobs to be true")

    @property
    def max_completion(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_completion_param(self) -> str:
        """The field max_completion comes from."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    async def grammar(self) -> str | None:
        """response_format's grammar, compiled in a thread: llguidance may take seconds on
        a large schema (it releases the GIL), and the server's loop goes on meanwhile."""
        if self.response_format is None:
            return None
        return await asyncio.to_thread(self.response_format.grammar)

    def params(self, prompt: list[int], max_tokens: int, grammar: str | None) -> GenParams:
        return GenParams(prompt=prompt, max_tokens=max_tokens,
                         logprobs=(self.top_logprobs or 0) if self.logprobs else None,
                         grammar=grammar, **self.sampling())


class TokenizeRequest(Body):
    """POST /tokenize, as vLLM's: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def context_check(context: int, prompt: int, completion: int | None, where: str,
                  completion_param: str = "max_tokens") -> int:
    """The completion's length; a 400 with the lengths when prompt and completion pass the
    model's context (no completion length asked: what the context leaves), naming the
    prompt (`where`), or the completion's field (`completion_param`) when the completion
    alone leaves no room for a prompt."""
    if completion is None and prompt < context:
        return context - prompt
    if completion is not None and prompt + completion <= context:
        return completion
    what = "messages" if where == "messages" else "prompt"
    if completion is None:
        detail = f"However, your {what} resulted in {prompt} tokens."
    else:
        detail = (f"However, you requested {prompt + completion} tokens ({prompt} in the "
                  f"{what}, {completion} in the completion).")
    param = completion_param if completion is not None and completion >= context else where
    raise ApiError(400, f"This model's maximum context length is {context} tokens. {detail} "
                   f"Please reduce the length of the {what} or completion.", param=param,
                   code="context_length_exceeded")


# -- responses ---------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_object(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def chat_logprob(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
            "top_logprobs": [{"token": text, "logprob": lp, "bytes": b}
                             for text, b, lp in t.top]}


class Choice:
    """One choice's text, logprobs and finish reason, gathered from its Deltas. A logprob
    entry is a TokenLogprob (chat), or a completion token's text and its TokenLogprob (None
    for the echoed prompt's first, which has none)."""

    def __init__(self) -> None:
        self.text = ""
        self.logprobs: list[Any] = []
        self.finish_reason: str | None = None


class Reply:
    """A request's response and stream chunks; the endpoint's subclass gives the shapes."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str, fingerprint: str, n: int, include_usage: bool):
        self.id = new_id(self.id_prefix)
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        self.include_usage = include_usage
        self.choices = [Choice() for _ in range(n)]

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def started(self, gen: Batch) -> list[bytes]:
        """The generation gave its first Delta: the chunks a stream sends before it."""
        return []

    def add(self, delta: Delta) -> None:
        c = self.choices[delta.index]
        c.text += delta.text
        c.logprobs += delta.logprobs
        c.finish_reason = delta.finish_reason or c.finish_reason

    def response(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(self.object),
                "choices": [self.choice(i, c) for i, c in enumerate(self.choices)],
                "usage": usage_object(usage)}

    def chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body = {**self._head(self.chunk_object), "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        return sse({**self._head(self.chunk_object), "choices": [],
                    "usage": usage_object(usage)})

    def choice(self, index: int, c: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def delta_chunk(self, delta: Delta) -> bytes | None:
        """A Delta's chunk; None when it has nothing to say (text held back)."""
        raise NotImplementedError


class ChatReply(Reply):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, fingerprint: str, req: ChatRequest):
        super().__init__(model, fingerprint, req.n, req.include_usage)
        self.logprobs = req.logprobs

    def _logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [chat_logprob(t) for t in lps], "refusal": None}

    def choice(self, index: int, c: Choice) -> dict[str, Any]:
        return {"index": index,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason}

    def started(self, gen: Batch) -> list[bytes]:
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])
                for i in range(len(self.choices))]

    def delta_chunk(self, delta: Delta) -> bytes | None:
        if not (delta.text or delta.finish_reason or delta.logprobs):
            return None
        body = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        return self.chunk([{"index": delta.index, "delta": body,
                            "logprobs": self._logprobs(delta.logprobs),
                            "finish_reason": delta.finish_reason}])


Piece = tuple[str, TokenLogprob | None]  # a token's text in `text`, and its logprob


def _top(t: TokenLogprob) -> dict[str, float]:
    """A token's top_logprobs, the chosen token among them: tokens whose texts are the same
    (two bytes of split characters both show U+FFFD) keep the largest logprob, so that the
    largest value is the most likely token's, as clients' greedy checks assume."""
    top: dict[str, float] = {}
    for text, lp in ((t.token, t.logprob), *((s, lp) for s, _, lp in t.top)):
        top[text] = max(lp, top.get(text, lp))
    return top


class CompletionReply(Reply):
    """Completions' logprobs are the legacy shape: parallel lists of tokens, their
    logprobs, each one's top alternatives as {text: logprob} (the chosen token among them,
    as vLLM's; tokens of the same text keep the largest), and each token's offset in the
    choice's text.

    A token's entry in `tokens` is the text it adds to the choice's `text` (special ids
    none, the first bytes of a split character none), so "".join(tokens) is the text (but
    for the part a stop string cut) and each text_offset the length of the text before
    it. A top_logprobs key is the token's own text, decoded alone (a special id's name)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, fingerprint: str, req: CompletionRequest,
                 echoes: list[list[str]] | None):
        """echoes: per prompt, its tokens' texts, when the choices' text starts with the
        prompt (echo)."""
        super().__init__(model, fingerprint, len(req.prompt) * req.n, req.include_usage)
        self.n = req.n
        self.logprobs = req.logprobs
        self.echoes = echoes
        self.batch: Batch | None = None  # the Batch, once started: its prompts' logprobs
        self.echoed = [echoes is None] * len(self.choices)
        self.offsets = [0] * len(self.choices)  # a stream's text offset of the next token

    def _logprobs(self, pieces: list[Piece], offset: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for text, t in pieces:
            offsets.append(offset)
            tokens.append(text)
            values.append(None if t is None else t.logprob)
            tops.append(None if t is None else _top(t))
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def choice(self, index: int, c: Choice) -> dict[str, Any]:
        return {"index": index, "text": c.text, "logprobs": self._logprobs(c.logprobs, 0),
                "finish_reason": c.finish_reason}

    def started(self, gen: Batch) -> list[bytes]:
        self.batch = gen
        return []

    def _echo(self, index: int) -> list[Piece] | None:
        """The echoed prompt of choice `index`, once: before the choice's first Delta (its
        prompt's logprobs are known by then)."""
        if self.echoed[index]:
            return None
        self.echoed[index] = True
        prompt = index // self.n
        texts = self.echoes[prompt] if self.echoes is not None else []
        scores = (self.batch.generations[prompt].prompt_logprobs
                  if self.logprobs is not None and self.batch is not None else None)
        return list(zip(texts, scores or [None] * len(texts), strict=True))

    @staticmethod
    def _pieces(delta: Delta) -> list[Piece]:
        return list(zip(delta.pieces, delta.logprobs or [None] * len(delta.pieces),
                        strict=True))

    def add(self, delta: Delta) -> None:
        c = self.choices[delta.index]
        if (echo := self._echo(delta.index)) is not None:
            c.text += "".join(text for text, _ in echo)
            c.logprobs += echo
        c.text += delta.text
        c.logprobs += self._pieces(delta)
        c.finish_reason = delta.finish_reason or c.finish_reason

    def _text_chunk(self, index: int, text: str, pieces: list[Piece],
                    finish_reason: str | None) -> bytes:
        logprobs = self._logprobs(pieces, self.offsets[index])
        self.offsets[index] += sum(len(t) for t, _ in pieces)
        return self.chunk([{"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": finish_reason}])

    def delta_chunk(self, delta: Delta) -> bytes | None:
        out = b""
        if (echo := self._echo(delta.index)) is not None:
            out += self._text_chunk(delta.index, "".join(t for t, _ in echo), echo, None)
        if delta.text or delta.finish_reason or delta.logprobs:
            out += self._text_chunk(delta.index, delta.text, self._pieces(delta),
                                    delta.finish_reason)
        return out or None

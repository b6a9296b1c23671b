"""openai_server: an OpenAI-compatible HTTP server, built as a LIP on the syscalls.

    symphony serve [--socket KERNEL_SOCKET] --port 8000 --api-key KEY
    symphony run lips/openai_server.py --port 8000      (the same program)

    curl localhost:8000/v1/chat/completions -H 'Authorization: Bearer KEY' \\
        -H 'Content-Type: application/json' \\
        -d '{"model": "MODEL", "messages": [{"role": "user", "content": "Hi"}]}'

Clients of OpenAI's API (the `openai` package, LangChain, curl) point their base URL at
http://HOST:PORT/v1. The endpoints:

    GET  /v1/models              the served model (--model-name; default: the kernel's)
    POST /v1/completions         prompt: a string, an array of strings, an array of token
                                 ids, or an array of token-id arrays (a batch: n choices
                                 per prompt, prompt i's choice j at index i*n+j, the
                                 prompts computed together); max_tokens (default 16; 0:
                                 nothing sampled, with echo and logprobs the prompt's
                                 scores), temperature, top_p, top_k, min_p, n, stop, seed,
                                 logprobs, echo, stream, logit_bias, ignore_eos,
                                 add_special_tokens
    POST /v1/chat/completions    messages through the model's chat template; max_tokens or
                                 max_completion_tokens, temperature, top_p, n, stop, seed,
                                 add_special_tokens,
                                 stream (stream_options.include_usage), logprobs and
                                 top_logprobs, logit_bias, response_format (text,
                                 json_object, json_schema: the output is held to the schema
                                 by logit masks, as lips/constrained.py does)
    GET  /health                 200 while the kernel answers (within 5 s), else 503
    GET  /metrics                Prometheus metrics, named as vLLM's (symphony:...)
    POST /tokenize, /detokenize  as vLLM's: {prompt} or {messages} -> {tokens, count,
                                 max_model_len}; {tokens} -> {prompt}

Streams are server-sent events ending with `data: [DONE]`. Errors are OpenAI's error
objects: a bad, unsupported or unknown field is a 400 naming it, a prompt past the model's
context a 400 with the lengths, an unknown model 404, a missing or wrong key 401 (--api-key
or $SYMPHONY_API_KEY guards /v1/*, /tokenize and /detokenize; /health and /metrics are
open; checked before the body is read), a body over --max-body-bytes 413, the kernel out of
KV memory 503 (once the prefix cache has nothing idle left to evict and waiting for other
requests to end cannot help: lips/serving/prefix_cache.py).

The engine's usual features are this program's logic over the syscalls: each request is a
process's KV files (lips/serving/generation.py), stop strings and n are decided here, and
the prefix cache (lips/serving/prefix_cache.py) keeps KV files of recent prompts'
page-aligned prefixes, so requests that share a system prompt fork its KV instead of
computing it again (usage.prompt_tokens_details.cached_tokens). A client that disconnects
has its generation cancelled and its pages freed at once.

Once it accepts connections it prints `symphony serve: listening on http://HOST:PORT` (the
real port with --port 0). SIGTERM (or Ctrl-C): it stops accepting, ends every open stream
with `data: [DONE]` (its generation cancelled), answers unfinished requests 503, closes the
prefix cache and exits 0. The kernel stopping or dying ends it the same way, but with exit
status 1 and `symphony serve: the kernel has gone (REASON); the server exits` on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hmac
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import uvicorn
import uvloop
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from lips.serving.errors import ApiError, bad_field, from_kernel, gone
from lips.serving.generation import Batch, Delta, Generator, GenParams
from lips.serving.metrics import Metrics
from lips.serving.prefix_cache import PrefixCache
from lips.serving.protocol import (
    DONE,
    MAX_PROMPTS,
    ChatReply,
    ChatRequest,
    CompletionReply,
    CompletionRequest,
    DetokenizeRequest,
    Reply,
    TokenizeRequest,
    chat_messages,
    check_token_ids,
    context_check,
    sse,
)
from lips.serving.request_gate import RequestGate
from lips.serving.text import text_bytes, token_pieces
from syscalls.aio import AsyncKernel
from syscalls.convert import ModelInfo, Vocabulary, proc_fields
from syscalls.flags import report, stdout_flushed

PROG = "symphony serve"
LISTENING = "symphony serve: listening on"
SHUTDOWN_GRACE_S = 30.0  # after SIGTERM: for responses already being written to finish
PROBE_WAIT_S = 5.0  # /health's and /metrics' wait for the kernel's answer, then 503
WATCH_S = 1.0  # how often the server checks that its kernel session is alive
log = logging.getLogger("symphony.serve")
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Service:
    """The server's state: one kernel session for every request, the model, the Generator,
    and the requests in flight (for SIGTERM)."""

    def __init__(self, kernel: AsyncKernel, info: ModelInfo, vocab: Vocabulary,
                 generator: Generator, cache: PrefixCache, metrics: Metrics, model: str,
                 api_key: str | None, special_prefix: list[int]):
        self.kernel = kernel
        self.special_prefix = special_prefix  # what add_special_tokens puts before a text
        self.pieces = text_bytes(vocab)
        self.generator = generator
        self.cache = cache
        self.metrics = metrics
        self.model = model
        self.info = info
        self.api_key = api_key
        self.fingerprint = f"fp_{info.fingerprint[:10]}"
        self.created = int(time.time())
        self.stopping = False
        self.open: set[Batch] = set()  # the generations running or streaming

    # -- checks -----------------------------------------------------------------------

    def key_error(self, authorization: str) -> ApiError | None:
        """The 401 of a request with this Authorization header, or None (request_gate.py
        asks before the body is read)."""
        if self.api_key is None:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return ApiError(401, "You didn't provide an API key: send it as the header "
                            "'Authorization: Bearer KEY'.", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    # -- tokens -----------------------------------------------------------------------

    async def chat_tokens(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                          add_special: bool) -> list[int]:
        """The messages through the model's chat template; a template that refuses them
        (roles out of order, no template) is the request's fault. add_special: the special
        tokens the tokenizer puts before a text (BOS) go before the template's, as vLLM's
        add_special_tokens (the kernel's tokenize of messages adds none)."""
        try:
            ids = await self.kernel.tokenize(messages=messages,
                                             add_generation_prompt=add_generation_prompt,
                                             add_special=add_special)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS):
                raise bad_field("messages", e.strerror or str(e)) from e
            raise from_kernel(e) from e
        prefix = self.special_prefix
        if add_special and ids[:len(prefix)] != prefix:
            ids = prefix + ids
        return ids

    # -- generation -------------------------------------------------------------------

    async def respond(self, request: Request, reply: Reply, params: list[GenParams],
                      stream: bool) -> Response:
        """The request's response, or its stream: one generation per prompt, all at once.
        A client that disconnects, before or during the stream, has its generations closed
        at once (their preds cancelled, their files freed)."""
        if self.stopping:
            raise shutting_down()
        gen = Batch(self.generator, params)
        self.open.add(gen)
        streaming = False
        try:
            if not stream:
                body = await watch(request.receive, collect(gen, reply))
                if self.stopping and any(c.finish_reason is None for c in reply.choices):
                    raise shutting_down()
                return JSONResponse(body)
            # Every choice's first Delta (of every prompt of a batch) comes before the
            # headers, so that a request the kernel refuses (out of KV memory), in any of
            # its prompts or choices, gets its status, not a 200 and an error event.
            deltas = aiter(gen)
            firsts = await watch(request.receive, first_deltas(deltas, len(reply.choices)))
            if not firsts:
                raise shutting_down()
            streaming = True
            return EventStream(events(reply, gen, deltas, firsts), lambda: self.close(gen))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not streaming:
                await self.close(gen)

    async def close(self, gen: Batch) -> None:
        self.open.discard(gen)
        await gen.aclose()

    def stop(self) -> Awaitable[Any]:
        """SIGTERM: refuse new requests from now on and end the running ones: their
        generations are closed, so each stream ends with [DONE] and an unfinished response
        is a 503. Await the result for all of them to be closed."""
        self.stopping = True
        return asyncio.gather(*(gen.aclose() for gen in list(self.open)))


async def _ids(ids: list[int]) -> list[int]:
    return ids


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="overloaded_error")


async def disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Returns when the client has gone (the body is already read: the next message is
    the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def watch(receive: Callable[[], Awaitable[dict[str, Any]]], work: Awaitable[T]) -> T:
    """What `work` gives, unless the client disconnects first (ClientGone: `work` is
    cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task not in done:
        raise ClientGone
    return task.result()


async def collect(gen: Batch, reply: Reply) -> dict[str, Any]:
    """A response: every Delta gathered."""
    started = False
    async for delta in gen:
        if not started:
            reply.started(gen)
            started = True
        reply.add(delta)
    return reply.response(gen.usage)


async def first_deltas(deltas: AsyncIterator[Delta], choices: int) -> list[Delta]:
    """The Deltas up to the first of each of the `choices` (indices 0..choices-1), so that
    every choice has started, or fewer when the Deltas end first (closed: SIGTERM). A
    choice's or prompt's failure raises from here."""
    firsts: list[Delta] = []
    waiting = set(range(choices))
    while waiting:
        delta = await anext(deltas, None)
        if delta is None:
            break
        firsts.append(delta)
        waiting.discard(delta.index)
    return firsts


async def events(reply: Reply, gen: Batch, deltas: AsyncIterator[Delta], firsts: list[Delta]
                 ) -> AsyncIterator[bytes]:
    """A stream's server-sent events: the opening chunks, a chunk per Delta with something
    to say (`firsts`, the Deltas awaited before the headers, then the rest), the usage
    chunk when asked, and [DONE], also after an error (an error event first) or a SIGTERM
    (the generation closed: its Deltas end)."""
    try:
        for chunk in reply.started(gen):
            yield chunk
        for delta in firsts:
            if (chunk := reply.delta_chunk(delta)) is not None:
                yield chunk
        while (delta := await anext(deltas, None)) is not None:
            if (chunk := reply.delta_chunk(delta)) is not None:
                yield chunk
        if reply.include_usage:
            yield reply.usage_chunk(gen.usage)
    except ApiError as e:
        yield sse(e.body())
    yield DONE


class EventStream(StreamingResponse):
    """A server-sent event stream that runs `on_close` however it ends: also when the
    client goes away before the first event is written (the events' own clean-up would
    never run then). The client's going is watched for (http.disconnect) all along, not
    left to the next write failing: a stream may write nothing for long (text held back
    for a stop string, a slow step), and Starlette's StreamingResponse listens only under
    an ASGI server older than spec 2.4."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await watch(receive, self.stream_response(send))
        except (ClientGone, OSError):  # gone (an ASGI 2.4 server's send raises OSError)
            pass  # nobody reads the rest
        finally:
            await self.on_close()


# -- the app ------------------------------------------------------------------------------


def error_param(loc: tuple[Any, ...]) -> str | None:
    """A pydantic error location as OpenAI names the field: messages[1].content."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param or None


def is_json(content_type: str) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON: application/json or
    application/*+json, parameters (charset) aside."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/")
                                          and kind.endswith("+json"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        param = error_param(tuple(first.get("loc", ())))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        content_type = request.headers.get("content-type")
        if first.get("type") == "json_invalid":  # FastAPI's words lose json's: say them again
            where = json.JSONDecodeError(first["ctx"]["error"], e.body, first["loc"][-1])
            error = ApiError(400, f"the body is not valid JSON: {where}")
        elif param is None and first.get("type") == "missing":
            # FastAPI's "Field required" of the body as a whole: no body at all
            error = ApiError(400, "the body is not valid JSON: it is empty")
        elif param is None and not is_json(content_type or ""):
            # FastAPI reads such a body as bytes, not JSON (curl -d sends a form's type)
            got = (f"Content-Type {content_type!r}" if content_type else "no Content-Type")
            error = ApiError(400, "the body must be JSON sent with 'Content-Type: "
                             f"application/json' (the request has {got})")
        elif param is None:  # JSON, but null, an array, a string or a number
            error = ApiError(400, "the body must be a JSON object")
        elif first.get("type") == "extra_forbidden":  # OpenAI's words for a field it lacks
            error = ApiError(400, f"Unrecognized request argument supplied: {param}",
                             param=param)
        else:
            error = bad_field(param, message)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        detail = str(e.detail)
        if isinstance(bad := e.__cause__, UnicodeDecodeError):
            # FastAPI words a body json.loads cannot decode as "an error parsing the body"
            detail = (f"the body is not valid JSON: it is not valid {bad.encoding.upper()} "
                      f"(byte {bad.object[bad.start]:#04x} at offset {bad.start}: {bad.reason})")
        return JSONResponse(ApiError(e.status_code, detail, type=kind).body(),
                            status_code=e.status_code, headers=e.headers)

    @app.exception_handler(OSError)  # a syscall's: the status its errno says
    async def kernel_error(_request: Request, e: OSError) -> JSONResponse:
        error = from_kernel(e)
        if error.status == 500:
            log.error("request failed", exc_info=e)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def internal(_request: Request, e: Exception) -> JSONResponse:
        log.error("request failed", exc_info=e)
        return JSONResponse(ApiError(500, f"internal error: {e}", type="internal_error").body(),
                            status_code=500)


def max_body_bytes(context: int) -> int:
    """The default body limit: 2048 prompts of a whole context as token ids (a comma and up
    to seven digits each), and a MiB for the other fields."""
    return MAX_PROMPTS * context * 8 + (1 << 20)


def build_app(s: Service, max_body: int) -> FastAPI:
    app = FastAPI(title="Symphony", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(RequestGate, key_error=s.key_error, max_body=max_body)
    guarded = APIRouter()  # the API key's paths (request_gate.GUARDED)
    info, k = s.info, s.kernel

    def model_card() -> dict[str, Any]:
        return {"id": s.model, "object": "model", "created": s.created, "owned_by": "symphony",
                "root": info.name, "max_model_len": info.context_length}

    @guarded.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @guarded.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        s.check_model(model)
        return model_card()

    @guarded.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        s.check_model(req.model)
        req.check(info.vocab_size)
        prompts = await asyncio.gather(*(
            k.tokenize(p, add_special=req.add_special_tokens) if isinstance(p, str) else _ids(p)
            for p in req.prompt))
        params = []
        for i, prompt in enumerate(prompts):
            if not prompt:  # text that tokenizes to nothing (no BOS added)
                raise bad_field(req.where(i), "the prompt has no tokens")
            max_tokens = context_check(info.context_length, len(prompt), req.max_tokens,
                                       req.where(i))
            params.append(req.params(prompt, max_tokens))
        # The echoed text is the prompt's tokens decoded as generated text is: "".join of
        # the tokens' texts, so that text, tokens and text_offset agree.
        echoes = [token_pieces(s.pieces, p) for p in prompts] if req.echo else None
        reply = CompletionReply(s.model, s.fingerprint, req, echoes)
        return await s.respond(request, reply, params, req.stream)

    @guarded.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatRequest) -> Response:
        s.check_model(req.model)
        req.check(info.vocab_size)
        prompt = await s.chat_tokens(chat_messages(req.messages), add_generation_prompt=True,
                                     add_special=req.add_special_tokens)
        max_tokens = context_check(info.context_length, len(prompt), req.max_completion,
                                   "messages", req.max_completion_param)
        reply = ChatReply(s.model, s.fingerprint, req)
        params = req.params(prompt, max_tokens, await req.grammar())
        return await s.respond(request, reply, [params], req.stream)

    @guarded.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        s.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_field("prompt", "give either prompt or messages")
        if req.messages is not None:
            tokens = await s.chat_tokens(chat_messages(req.messages), req.add_generation_prompt,
                                         bool(req.add_special_tokens))
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await k.tokenize(req.prompt or "", add_special=special)
        return {"count": len(tokens), "max_model_len": info.context_length, "tokens": tokens}

    @guarded.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        s.check_model(req.model)
        check_token_ids(req.tokens, info.vocab_size, "tokens")
        return {"prompt": await k.detokenize(req.tokens)}

    async def of_kernel(call: Awaitable[T]) -> T:
        """/health's and /metrics' kernel call: 503 when the kernel does not answer, within
        PROBE_WAIT_S (a kernel stopped with SIGSTOP, or stuck, answers nothing)."""
        try:
            return await asyncio.wait_for(call, PROBE_WAIT_S)
        except TimeoutError as e:
            raise ApiError(503, f"the kernel did not answer within {PROBE_WAIT_S:g} s",
                           type="overloaded_error") from e
        except OSError as e:
            raise ApiError(503, f"the kernel does not answer: {e}", type="overloaded_error") from e

    @app.get("/health")
    async def health() -> Response:
        await of_kernel(k.getpid())
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await of_kernel(s.metrics.exposition(k, s.cache))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    app.include_router(guarded)
    return app


# -- the program ------------------------------------------------------------------------


class HttpServer(uvicorn.Server):
    """uvicorn on a socket bound here, saying once that it listens; SIGTERM is the
    program's (uvicorn's own handler would re-raise it at the end: exit status 143)."""

    def __init__(self, config: uvicorn.Config, url: str):
        super().__init__(config)
        self.url = url

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"{LISTENING} {self.url}", flush=True)


def bind(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening TCP socket and its URL (the real port when port is 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as e:  # its errno is the resolver's, not an OS one
        sock.close()
        raise ValueError(f"--host {host}: {e.strerror}") from e
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{sock.getsockname()[1]}"


async def special_prefix(k: AsyncKernel) -> list[int]:
    """The ids the tokenizer puts before a text with its special tokens (BOS), found by
    tokenizing a probe both ways; none without a tokenizer."""
    try:
        plain, special = await k.tokenize("a"), await k.tokenize("a", add_special=True)
    except OSError:
        return []
    at = next((i for i in range(len(special) - len(plain) + 1)
               if special[i:i + len(plain)] == plain), 0)
    return special[:at]


async def kernel_gone(k: AsyncKernel) -> OSError:
    """Returns, with the reason, once the kernel has stopped or died: the session's calls
    fail with EPIPE (unreachable, or stopping), or the kernel has reaped the process. A
    kernel slow to answer (busy, stopped with SIGSTOP) is not gone."""
    while True:
        await asyncio.sleep(WATCH_S)
        try:
            await asyncio.wait_for(k.getpid(), PROBE_WAIT_S)
        except TimeoutError:
            continue
        except OSError as e:
            if gone(e):
                return e


async def default_cache_pages(k: AsyncKernel) -> int:
    """A quarter of the kernel's device pages."""
    return int(proc_fields(await k.procfs("meminfo")).get("device_total", 0)) // 4


async def serve(args: argparse.Namespace) -> int:
    sock, url = bind(args.host, args.port)
    with sock:
        async with await AsyncKernel.connect(args.socket, name="openai_server") as k:
            info, vocab = await k.model_info(), await k.vocab()
            pages = args.prefix_cache_pages
            cache = PrefixCache(k, info.page_size,
                                await default_cache_pages(k) if pages is None else pages)
            model = args.model_name or info.name
            metrics = Metrics(model)
            service = Service(k, info, vocab, Generator(k, info, vocab, cache, metrics), cache,
                              metrics, model, args.api_key or None, await special_prefix(k))
            max_body = args.max_body_bytes or max_body_bytes(info.context_length)
            config = uvicorn.Config(build_app(service, max_body), lifespan="off",
                                    log_level="warning",
                                    access_log=False,
                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
            server = HttpServer(config, url)

            closing: list[Awaitable[Any]] = []  # referenced until done
            gone: list[OSError] = []

            def stop() -> None:
                server.should_exit = True  # uvicorn stops accepting, then waits for streams
                closing.append(service.stop())

            async def watch_kernel() -> None:  # a kernel gone ends the server as SIGTERM
                gone.append(await kernel_gone(k))
                stop()

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop)
            watcher = asyncio.create_task(watch_kernel())
            try:
                await server.serve(sockets=[sock])
            finally:
                watcher.cancel()
                await service.stop()
                await cache.close()
    if gone:
        reason = (gone[0].strerror or str(gone[0])).splitlines()[0]
        print(f"{PROG}: the kernel has gone ({reason}); the server exits", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", metavar="SOCK", help="the kernel's socket (default: "
                   "$SYMPHONY_SOCKET, which symphony serve and run set, else "
                   "/tmp/symphony/kernel.sock)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "%(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default %(default)s; "
                   "0: any free port, printed)")
    p.add_argument("--api-key", default=os.environ.get("SYMPHONY_API_KEY"), metavar="KEY",
                   help="the key clients must send as 'Authorization: Bearer KEY' "
                   "(default: $SYMPHONY_API_KEY; none: no key needed)")
    p.add_argument("--prefix-cache-pages", type=int, metavar="N",
                   help="KV pages the prefix cache may keep (default: a quarter of the "
                   "kernel's device pages; 0: no prefix cache)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model's name in the API (default: the kernel's model name)")
    p.add_argument("--max-body-bytes", type=int, metavar="N",
                   help="the largest request body taken, larger is 413 (default: 2048 "
                   "prompts of the model's whole context as token ids, and 1 MiB)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The server's exit status; a reader of its output gone is 141, quietly, as the other
    programs end (syscalls.flags.stdout_flushed). Once it serves, SIGINT stops it as
    SIGTERM does."""
    return stdout_flushed(PROG, lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefix_cache_pages is not None and args.prefix_cache_pages < 0:
        parser.error("--prefix-cache-pages must be >= 0")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        parser.error(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    try:
        return uvloop.run(serve(args))
    except (OSError, ValueError) as e:
        return report(PROG, e)


if __name__ == "__main__":
    sys.exit(main())

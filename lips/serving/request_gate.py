"""What a request passes before the server reads its body: the API key, on the paths the
key guards, and a limit on the body's size.

FastAPI reads a body whole, and parses it, before any dependency of its route runs: an API
key checked there is checked only after a client without it has had the server hold
whatever it sent. This ASGI middleware answers from the headers first (401 for a missing or
wrong key; 413 for a Content-Length past the limit), and counts a body sent without one
(chunked) as it arrives, refusing it (413) once it passes the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from lips.serving.errors import ApiError

GUARDED = ("/v1/", "/tokenize", "/detokenize")  # what the key guards (/health, /metrics: open)


def guarded(path: str) -> bool:
    return path.startswith(GUARDED[0]) or path in GUARDED[1:]


def too_large(size: int | str, limit: int) -> str:
    return (f"the request body is {size} bytes or more, over the {limit} this server takes "
            "(--max-body-bytes)")


class RequestGate:
    """The middleware: `key_error(authorization header)` is the error of a request the key
    refuses, or None."""

    def __init__(self, app: Any, key_error: Callable[[str], ApiError | None], max_body: int):
        self.app, self.key_error, self.max_body = app, key_error, max_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        error = self.key_error(headers.get("authorization", "")) if guarded(scope["path"]) else None
        length = headers.get("content-length", "0").strip()
        # A count of more than 19 digits (int() refuses past 4300) is over any limit.
        counted = length.isascii() and length.isdigit()
        if error is None and not (counted and len(length) <= 19 and int(length) <= self.max_body):
            error = ApiError(413, too_large(length, self.max_body) if counted
                             else f"the Content-Length {length[:40]!r} is not a byte count")
        if error is not None:
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Any) -> Any:
        """receive(), refusing a body once more than max_body bytes of it came (FastAPI
        passes an HTTPException raised while it reads the body on to the error handlers)."""
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise HTTPException(413, too_large(seen, self.max_body))
            return message

        return counted

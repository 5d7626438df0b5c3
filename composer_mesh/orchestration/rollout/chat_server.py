"""The harness endpoint's web server: OpenAI Chat Completions plus two episode routes, in the controller's loop.

Why in the controller's event loop (a uvicorn server as one of the run's tasks) rather than a process of its
own: a request's turn goes on the same queue the generators take turns from (`turns.TurnQueue`), so handlers
await it directly and concurrent agents' turns batch into one generator request, with nothing to forward.
uvicorn's signal capture is switched off: the run owns SIGINT and SIGTERM (`app/runner.py`) and stops this
server with its other tasks.

Routes: `POST /v1/chat/completions` (the episode named by the `X-Episode-Id` header or `metadata.episode_id`),
`GET /v1/models`, `GET /v1/episodes/next?wait_s=` (an outside agent's next task, long-polled; 204 when none came)
and `POST /v1/episodes/{id}/end` with `{"reward": number | null}`. With a token every route needs
`Authorization: Bearer <token>` (the `openai` client's `api_key`), compared in constant time; the token is never
logged or echoed. Errors are OpenAI-style JSON (`chat_wire.WireError`), one line naming what was wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from composer_mesh.orchestration.rollout.chat_wire import (
    ChatRequest,
    ServedTurn,
    WireError,
    completion,
    read_request,
    stream_chunks,
)

log = logging.getLogger("composer_mesh.harness")
EPISODE_HEADER = "x-episode-id"


class EpisodeEndpoint(Protocol):
    """What the server serves (`harness_episodes.EpisodeRegistry`)."""

    async def chat(self, episode_id: str, request: ChatRequest) -> ServedTurn:
        """Serve one turn of `episode_id`'s conversation (raises `WireError` for a request it refuses)."""
        ...

    async def next_task(self, wait_s: float) -> dict[str, Any] | None:
        """The next task for an outside agent, or None after `wait_s` seconds without one."""
        ...

    def end(self, episode_id: str, body: Any) -> None:
        """The agent's report that the episode is over, with its reward."""
        ...


def authorized(header: str | None, token: str | None) -> bool:
    """Whether an `Authorization` header carries `token` (always, when no token is required)."""
    if token is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def episode_of(request: Request, chat: ChatRequest) -> str:
    """The request's episode id: the header or `metadata.episode_id` (the same one if both are given)."""
    header = request.headers.get(EPISODE_HEADER)
    if header and chat.episode_id and header != chat.episode_id:
        raise WireError("X-Episode-Id and metadata.episode_id name different episodes", "metadata")
    episode = header or chat.episode_id
    if not episode:
        raise WireError("no episode id: send the X-Episode-Id header or metadata.episode_id (each task has one)",
                        "metadata")
    return episode


def build_app(episodes: EpisodeEndpoint, token: str | None, model: str) -> FastAPI:
    """The FastAPI app over `episodes`; `token` None: no authentication (a loopback bind without token_env)."""
    app = FastAPI(title="composer-mesh harness endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    if token is not None:
        app.add_middleware(BearerGuard, token=token)

    @app.exception_handler(WireError)
    async def refused(request: Request, e: WireError) -> Response:
        return _error(e)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json(request)
        chat = read_request(body)
        turn = await episodes.chat(episode_of(request, chat), chat)
        name = f"chatcmpl-{uuid.uuid4().hex}"
        if not chat.stream:
            return JSONResponse(completion(chat, turn, name, model))
        return StreamingResponse(_events(stream_chunks(chat, turn, name, model)), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "composer-mesh"}]}

    @app.get("/v1/episodes/next")
    async def next_task(wait_s: float = 30.0) -> Response:
        task = await episodes.next_task(min(max(wait_s, 0.0), 300.0))
        return Response(status_code=204) if task is None else JSONResponse(task)

    @app.post("/v1/episodes/{episode_id}/end")
    async def end(episode_id: str, request: Request) -> dict[str, Any]:
        episodes.end(episode_id, await _json(request))
        return {"episode_id": episode_id, "ended": True}

    return app


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as e:
        raise WireError(f"the request body is not JSON ({e.msg})") from None


def _error(e: WireError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _events(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


class BearerGuard:
    """Refuses every request without `Authorization: Bearer <token>` (401), before any route runs. A plain ASGI
    middleware rather than FastAPI's `@app.middleware("http")`, whose per-request task and streams cost more than
    the check itself: every turn of every episode passes here."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not authorized(header, self.token):
                refusal = WireError("a valid bearer token is required (Authorization: Bearer <token>)", None, 401)
                await _error(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RunOwnsSignals(uvicorn.Server):
    """uvicorn without its signal handlers: the run's own SIGINT/SIGTERM handling stays in place."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ChatServer:
    """The endpoint bound to `host:port` (0: a free port) at construction, so `base_url` is known before it
    serves; `serve()` runs until cancelled and then closes the listening socket."""

    def __init__(self, episodes: EpisodeEndpoint, host: str, port: int, token: str | None, model: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(episodes, token, model), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        self.server = _RunOwnsSignals(config)

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    async def serve(self) -> None:
        log.info("harness endpoint serving at %s", self.base_url)
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            for server in getattr(self.server, "servers", []):
                server.close()
            self.sock.close()

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Stop serving (`task` runs `serve`) and wait until it has."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)

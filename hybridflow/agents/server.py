"""The OpenAI-compatible endpoint: `POST /s/<session>/v1/chat/completions` and
`GET /s/<session>/v1/models`, served on the asyncio loop the request engine runs on, in the
rollout worker's process. One session per trajectory; an agent's client points at
`server.base_url(session)`.

aiohttp serves it: its `AppRunner` + `TCPSite` start and stop a server on the running loop in a
few lines, with nothing else to run. uvicorn (under fastapi) is built to own the process (its
`Server.serve` installs signal handlers and its own shutdown), and fastapi adds pydantic models
of a format `openai_api.py` already checks. Both are vLLM dependencies, so neither adds weight.
"""

import itertools
import json
import logging
from collections.abc import Callable

from aiohttp import web

from hybridflow.agents.chat_session import ChatSession, GenerateChat
from hybridflow.agents.openai_api import (
    ApiError,
    ChatRequest,
    chunk_bodies,
    completion_body,
    models_body,
    parse_chat_request,
)

logger = logging.getLogger(__name__)


SessionGenerate = Callable[[str], GenerateChat]  # a session's name -> how its requests are sampled


class ChatServer:
    """`async with ChatServer(cfg, generate, check) as server:` serves `server.sessions` while
    open; `generate(session name)` samples that session's requests (a router keeps a session on one
    replica); `check(request)` raises ApiError for a request the rollout refuses (its sampling)."""

    def __init__(self, cfg, generate: SessionGenerate, check: Callable[[ChatRequest], None]):
        self.cfg, self.generate, self.check = cfg, generate, check  # cfg: engines.rollout.config.ServerConfig
        self.sessions: dict[str, ChatSession] = {}
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def base_url(self, session: str) -> str:
        return f"http://{self.cfg.host}:{self.port}/s/{session}/v1"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        app.router.add_get("/s/{session}/v1/models", self._models)
        return app

    async def __aenter__(self) -> "ChatServer":
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        try:
            await site.start()
        except OSError as err:
            await self._runner.cleanup()
            raise OSError(
                f"rollout.server cannot listen on {self.cfg.host}:{self.cfg.port} ({err}); "
                "set rollout.server.port=0 for a free port"
            ) from err
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    def _session(self, request: web.Request) -> ChatSession:
        name = request.match_info["session"]
        if name not in self.sessions:
            raise ApiError(f"no session {name!r}: use the base_url the rollout gave", status=404)
        return self.sessions[name]

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except ApiError as err:
            return web.json_response(err.body(), status=err.status)
        return web.json_response(models_body(self.cfg.model_name))

    async def _chat(self, request: web.Request) -> web.Response:
        session = None
        try:
            session = self._session(request)
            chat = parse_chat_request(await _json(request), self.cfg.model_name)
            self.check(chat)
            reply = await session.complete(chat, self.generate(session.name))
        except ApiError as err:
            return web.json_response(err.body(), status=err.status)
        except Exception as err:  # kept for the rollout to raise: the agent only sees a 500
            logger.exception("chat completion of session %s failed", session and session.name)
            if session is not None:
                session.errors.append(err)
            failed = ApiError(
                f"the rollout failed to serve the request: {type(err).__name__}: {err}", status=500
            )
            return web.json_response(failed.body(), status=500)
        request_id = f"chatcmpl-{session.name}-{next(self._ids)}"
        if chat.stream:
            usage = (reply.prompt_tokens, reply.completion_tokens) if chat.include_usage else None
            return await _stream(request, chunk_bodies(request_id, self.cfg.model_name, reply.turn, usage))
        body = completion_body(
            request_id, self.cfg.model_name, reply.turn, reply.prompt_tokens, reply.completion_tokens
        )
        return web.json_response(body)


async def _stream(request: web.Request, chunks: list[dict]) -> web.StreamResponse:
    """Server-sent events, as OpenAI streams: one `data: <chunk>` per chunk, then `data: [DONE]`."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _json(request: web.Request):
    try:
        return await request.json()
    except ValueError as err:
        raise ApiError(f"the request body is not valid JSON: {err}") from err

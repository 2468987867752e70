"""A minimal engine for overhead measurements: answers SGLang's routes at once, generating nothing.

It speaks just enough of SGLang's HTTP surface for a Session to dispatch to it: ``POST /generate``
(the reply echoes the request's ``rid`` in a fixed ``meta_info``; with ``"stream": true`` it streams
``sampling_params.max_new_tokens`` chunks as server-sent events, then ``[DONE]``, all at once),
``POST /abort_request``, ``GET /health`` and ``GET /get_server_info``. It runs in its own process (aiohttp, access log off)
so its work never shares the measuring client's event loop.

Usage: python bench/instant_engine.py --port PORT
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from aiohttp import web

__all__ = ["build_app", "main"]


def _generate_reply(rid: Any) -> dict[str, Any]:
    return {
        "text": " ok",
        "output_ids": [1],
        "meta_info": {
            "id": rid if isinstance(rid, str) else "instant",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "cached_tokens": 0,
        },
    }


async def _generate(request: web.Request) -> web.StreamResponse:
    body = json.loads(await request.read())
    rid = body.get("rid") if isinstance(body, dict) else None
    if isinstance(body, dict) and body.get("stream"):
        return await _stream(request, rid, body)
    return web.json_response(_generate_reply(rid))


async def _stream(request: web.Request, rid: Any, body: dict[str, Any]) -> web.StreamResponse:
    params = body.get("sampling_params")
    tokens = params.get("max_new_tokens", 8) if isinstance(params, dict) else 8
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    reply = _generate_reply(rid)
    for i in range(1, int(tokens) + 1):
        reply["output_ids"] = list(range(i))
        reply["meta_info"]["completion_tokens"] = i
        await response.write(b"data: " + json.dumps(reply).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _abort(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({})


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def _server_info(request: web.Request) -> web.Response:
    return web.json_response({"enable_lora": True, "max_loaded_loras": 8, "max_loras_per_batch": 8})


def build_app() -> web.Application:
    """The aiohttp application: the routes above and nothing else."""
    app = web.Application()
    app.router.add_post("/generate", _generate)
    app.router.add_post("/abort_request", _abort)
    app.router.add_get("/health", _health)
    app.router.add_get("/get_server_info", _server_info)
    return app


def main() -> None:
    """Serve on ``127.0.0.1:--port`` until terminated."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(build_app(), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()

"""A small OpenAI-style HTTP client: completions and chat, streamed or not, with TTFT."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    ok: bool
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    ttft_s: float = 0.0
    second_s: float = 0.0  # streamed: the next piece after the first (completions: token 2)
    total_s: float = 0.0
    status: int = 0
    error: str = ""
    request_id: str = ""  # the answer's X-Request-Id (the router's transfer id)
    sent_at: float = 0.0  # wall clock when the request was sent (to line up traces)


def request(
    url: str,
    model: str,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
    max_tokens: int = 16,
    stream: bool = False,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
    token_ids: bool = True,
    first_token: threading.Event | None = None,
) -> Reply:
    """POST one greedy completion (``prompt``) or chat (``messages``) and time it.
    ``token_ids``: ask for the prompt's and the output's token ids (tests compare them;
    benchmarks leave them out, as most clients do). ``first_token`` (streamed only) is set
    when the first token arrives, so a caller can act while the rest is still coming."""
    chat = messages is not None
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **({"return_token_ids": True} if token_ids else {}),
        **(extra or {}),
    }
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = urllib.request.Request(
        url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    sent_at = time.time()
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            rid = resp.headers.get("X-Request-Id", "")
            if stream:
                reply = _read_stream(resp, chat, start, first_token)
                reply.request_id, reply.sent_at = rid, sent_at
                return reply
            data = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return Reply(
            False,
            status=e.code,
            error=e.read().decode(errors="replace")[:500],
            total_s=time.perf_counter() - start,
        )
    except (urllib.error.URLError, OSError, ValueError) as e:
        return Reply(False, error=repr(e), total_s=time.perf_counter() - start)
    total = time.perf_counter() - start
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Reply(
        True,
        text or "",
        list(choice.get("token_ids") or []),
        int(data.get("usage", {}).get("prompt_tokens", 0)),
        total,
        total,
        200,
        request_id=rid,
        sent_at=sent_at,
    )


def _read_stream(
    resp: Any, chat: bool, start: float, first_token: threading.Event | None = None
) -> Reply:
    reply = Reply(True, status=200)
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            return Reply(False, error=str(chunk["error"]), total_s=time.perf_counter() - start)
        if chunk.get("usage"):
            reply.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece is None:
                continue
            if not reply.ttft_s:
                reply.ttft_s = time.perf_counter() - start
                if first_token is not None:
                    first_token.set()
            elif not reply.second_s:
                reply.second_s = time.perf_counter() - start
            reply.text += piece
            reply.token_ids += list(choice.get("token_ids") or [])
    reply.total_s = time.perf_counter() - start
    return reply

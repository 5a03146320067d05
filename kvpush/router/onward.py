"""D's request once more after its first token differed from P's, which the client has
(`kvpush.router.head`): D's later tokens would follow its own copy.

A completion goes on from P's token: D gets the prompt's ids as P computed them with P's
token after them, one token fewer to write (`continue_body`). P's leg returns P's token
id alone (`head.id_in_logprobs`), so the prompt's ids are found only here
(`prompt_ids`): the ids P's answer carried (a client that asked for them); else a prompt
of token ids as sent; else a text prompt as P's own /tokenize writes it (vLLM tokenizes
it there as in a completion: the same renderer, the client's ``add_special_tokens``, no
truncation for a prompt P took whole). A chat request, a completion whose prompt ids
cannot be known for sure (``truncate_prompt_tokens``: P cut the prompt; /tokenize failed
or answered what is not a prompt's ids) or whose penalties count written tokens
(`_BY_OUTPUT`), or a continuation D refuses, is computed again from the whole prompt as P
computed it (`again_body`); should that first token differ from P's too, the stream ends
with an error event rather than with a text no single server would write.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvpush.router import bodies, head, jsonbody, wire
from kvpush.router.call import Call

log = logging.getLogger("kvpush.router.app")

# Sampling fields that treat written tokens unlike prompt ones (penalties on the output
# only; bad words matched across written tokens): with P's token moved into D's prompt,
# D's next token could differ from a plain server's.
_BY_OUTPUT = ("frequency_penalty", "presence_penalty", "bad_words")
# The longest wait for P's /tokenize: the client has its first token and waits for the
# next; past this, D computes the request again instead.
TOKENIZE_S = 5.0
# The most of /tokenize's answer read: a prompt's ids at any context length vLLM serves
# fit many times.
_MAX_ANSWER = 16 * 1024 * 1024


def may_continue(dbody: dict[str, Any], first: head.Head) -> bool:
    """Whether D can go on from P's token (`continue_body`) given the prompt's ids: not
    when P's token id is unknown or its token has no text of its own (the first part of
    a character: D's text would then begin inside it) or text with U+FFFD (bytes that are
    no character: how the text after them reads depends on where the detokenizer started,
    which a prompt ending in P's token changes), or when the next token depends on which
    tokens were written rather than prompt (`_BY_OUTPUT`)."""
    text = first.texts.get("text")
    if len(first.p_token) != 1 or not text or "\ufffd" in text:
        return False
    return all(dbody.get(name) in (None, 0, 0.0, []) for name in _BY_OUTPUT)


def continue_body(
    dbody: dict[str, Any], first: head.Head, prompt: tuple[int, ...]
) -> dict[str, Any] | None:
    """D's request once more after its first token differed from P's, going on from P's
    token: `prompt`, the prompt's token ids as P computed them, with P's token after
    them, one token fewer to write, without P's KV (D's prefix cache may still hold the
    pushed blocks). None without `prompt` or when `may_continue` says no."""
    if not prompt or not may_continue(dbody, first):
        return None
    drop = ("kv_transfer_params", "truncate_prompt_tokens")  # the ids are P's, cut already
    out = {k: v for k, v in dbody.items() if k not in drop}
    out["prompt"] = [*prompt, *first.p_token]
    for name in ("max_tokens", "min_tokens"):
        count = out.get(name)
        if bodies.is_int(count) and count > 0:
            out[name] = count - 1
    return out


def again_body(dbody: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """D's request once more after its first token differed from P's: the client's body
    without P's KV, salted so that D's prefix cache (the blocks P pushed) does not serve
    it, and D computes the whole prompt, as P did, instead of the last token alone."""
    out = {k: v for k, v in dbody.items() if k != "kv_transfer_params"}
    out["cache_salt"] = f"kvpush-again-{transfer_id}"
    return out


class Unknown(Exception):
    """Why the prompt's ids cannot be known for sure."""


async def prompt_ids(call: Call, dbody: dict[str, Any], first: head.Head) -> tuple[int, ...]:
    """The prompt's ids as P computed them, for `continue_body`; () when they cannot be
    known for sure (logged, with why)."""
    try:
        return first.p_prompt or await _found(call, dbody)
    except Unknown as why:
        log.warning("transfer %s: no prompt ids to go on from P's token: %s", call.tid, why)
        return ()


async def _found(call: Call, dbody: dict[str, Any]) -> tuple[int, ...]:
    if dbody.get("truncate_prompt_tokens") is not None:
        raise Unknown("truncate_prompt_tokens: P's prompt was cut")
    prompt = dbody.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list (`head.eligible`)
    if isinstance(prompt, list) and prompt and bodies.all_ints(prompt):
        return tuple(prompt)
    if not isinstance(prompt, str):
        raise Unknown("a prompt that is neither text nor token ids")
    ask = {"prompt": prompt, "add_special_tokens": dbody.get("add_special_tokens", True)}
    if "model" in dbody:
        ask = {"model": dbody["model"], **ask}
    url = call.pair[0].url + "/tokenize"
    return await _tokenize(call.upstreams, url, ask, call.headers, min(call.timeout, TOKENIZE_S))


async def _tokenize(
    upstreams: wire.Upstreams,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: float,
) -> tuple[int, ...]:
    """vLLM's /tokenize of `body` at `url`: the prompt's ids, within `timeout` seconds;
    `Unknown` for any failure or an answer that is not a prompt's ids."""
    try:
        async with asyncio.timeout(timeout):
            resp = await upstreams.post(url, jsonbody.dump(body), headers, "application/json")
            try:
                if resp.status != 200:
                    raise Unknown(f"/tokenize answered HTTP {resp.status}")
                data = bytearray()
                while piece := await resp.readany():
                    data += piece
                    if len(data) > _MAX_ANSWER:
                        raise Unknown(f"/tokenize answered more than {_MAX_ANSWER} bytes")
            except BaseException:
                resp.close()
                raise
            resp.release()
    except TimeoutError:
        raise Unknown(f"/tokenize gave no answer within {timeout:g}s") from None
    except (OSError, ValueError) as exc:  # unreachable, or not an http(s) URL
        raise Unknown(f"/tokenize: {type(exc).__name__}: {exc}") from None
    try:
        answer = jsonbody.loads(bytes(data))
    except (ValueError, RecursionError):
        raise Unknown("/tokenize answered what is not JSON") from None
    return _ids(answer)


def _ids(answer: Any) -> tuple[int, ...]:
    """The ids of /tokenize's answer (``{"count", "max_model_len", "tokens"}``): a list of
    token ids, not empty, no longer than the model length it reports."""
    if not isinstance(answer, dict):
        raise Unknown("/tokenize answered what is not an object")
    ids, most = answer.get("tokens"), answer.get("max_model_len")
    if not bodies.is_int(most) or most < 1:
        raise Unknown(f"/tokenize answered max_model_len {str(most)[:50]}")
    if not isinstance(ids, list) or not ids or not bodies.all_ints(ids):
        raise Unknown("/tokenize answered tokens that are not a list of token ids")
    if len(ids) > most:
        raise Unknown(f"/tokenize answered {len(ids)} tokens, more than {most}")
    if min(ids) < 0 or max(ids) > head.MAX_ID:
        raise Unknown("/tokenize answered a token id out of range")
    return tuple(ids)

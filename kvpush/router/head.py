"""The client's first token from P's answer, for a streamed request.

P computes the prompt and its first token, as one plain server does. D computes that token
again from the pushed KV before it sends anything: its scheduler's notice, a step and the
async-scheduling lag come first (10-12 ms on one H200, docs/benchmarks.md). When D's first
token cannot differ from P's (greedy sampling), the client gets P's events for
that token as soon as P answers, and then D's stream without D's copy of them.

Only requests whose first events depend on that token alone qualify (`eligible`): no
stop strings (a plain server holds back text that may start one), no logprobs, no tools
or structured output (their parsers shape the deltas), one choice of one prompt, room
for a second token. P's leg for them is streamed like the client's (`prefill_body`), so its events
are the ones a plain server writes; the token's event is the last of P's stream, so its
``finish_reason`` is rewritten to none (`from_answer`). `Trim` then takes D's role
event and D's copy of the token out of D's stream.

Numerically, D's recomputed token can still differ from P's (a near tie between P's
prefill and D's one-token recompute). D's later tokens would follow from its own copy, so
the router drops that stream (D aborts the request) and asks D again. A completion goes on
from P's token: P's leg asks for the token ids (`return_token_ids`, taken out of the
client's events unless the client asked too), and D gets the prompt's ids with P's token
after them, one token fewer to write (`continue_body`); its stream then passes with its
usage counted as the client's request (`Continued`). A chat request, a completion whose
ids P's answer lacks or whose penalties count written tokens (`_BY_OUTPUT`), or a
continuation D refuses, is computed again from the whole prompt as P computed it
(`again_body`); should that first token differ from P's too, the stream ends with an
error event rather than with a text no single server would write.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from kvpush.router import bodies, jsonbody, legs, sse

# Fields whose presence changes the first events beyond the token: tool and structured
# output parsers, logprobs, echo, stop strings (held-back text), more than one choice.
_SHAPING = (
    "tools",
    "functions",
    "tool_choice",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "top_logprobs",
    "echo",
    "stop",
)
# Sampling fields that treat written tokens unlike prompt ones (penalties on the output
# only; bad words matched across written tokens): with P's token moved into D's prompt,
# D's next token could differ from a plain server's.
_BY_OUTPUT = ("frequency_penalty", "presence_penalty", "bad_words")
_END = b"\n\n"
# The most of P's answer `Early` holds looking for its first events: those of a
# one-token answer with a prompt's ids at any context length vLLM serves fit many times.
_MAX_HEAD = 16 * 1024 * 1024
_DONE = b"data: [DONE]"
# Chat delta fields a token's text can be in (a reasoning parser splits it).
_TEXT_FIELDS = frozenset(("content", "reasoning", "reasoning_content"))


def eligible(body: dict[str, Any], chat: bool) -> bool:
    """Whether the client can get P's first token (the request is streamed, D's first token
    is P's, and the first events depend on nothing else)."""
    if body.get("stream") is not True or body.get("n") not in (None, 1):
        return False
    if not all(_unset(body.get(name)) for name in _SHAPING):
        return False
    if not chat and (body.get("logprobs") is not None or not _one_prompt(body.get("prompt"))):
        return False  # a completion's `logprobs: false` reads as 0: the chosen token's
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        most = body.get(name)
        if most is not None and not (bodies.is_int(most) and most >= 2):
            return False
    # Greedy only: P's leg carries no seed (kvpush.router.bodies), so a sampled token of
    # P's would not be the one D (and a plain server) samples with the client's seed.
    temperature = body.get("temperature")
    number = isinstance(temperature, int | float) and not isinstance(temperature, bool)
    return number and temperature == 0


def _unset(value: Any) -> bool:
    # `logprobs: 0` asks for the chosen token's logprob: set, though falsy.
    return value is None or value is False or (isinstance(value, str | list) and not value)


def _one_prompt(prompt: Any) -> bool:
    """A completions prompt that is one prompt (several get a choice each)."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list):
        return False
    return len(prompt) == 1 or (bool(prompt) and bodies.all_ints(prompt))


def prefill_body(body: dict[str, Any], transfer_id: str, chat: bool) -> dict[str, Any]:
    """The prefill leg of an eligible request: streamed as the client's, one token."""
    out = bodies.prefill_body(body, transfer_id, chat)
    out["stream"] = True
    if body.get("stream_options") is not None:
        out["stream_options"] = body["stream_options"]
    if not chat:
        out["return_token_ids"] = True  # for `continue_body`; hidden unless asked
    return out


def ids_hidden(body: dict[str, Any], chat: bool) -> bool:
    """Whether P's answer carries token ids the client did not ask for (`prefill_body`)."""
    return not chat and body.get("return_token_ids") is not True


def continue_body(dbody: dict[str, Any], first: Head) -> dict[str, Any] | None:
    """D's request once more after its first token differed from P's, going on from P's
    token: the prompt's token ids as P computed them with P's token after them, one token
    fewer to write, without P's KV (D's prefix cache may still hold the pushed blocks).
    None when P's answer lacks the ids or its token has no text of its own (the first part
    of a character: D's text would then begin inside it) or text with U+FFFD (bytes that
    are no character: how the text after them reads depends on where the detokenizer
    started, which a prompt ending in P's token changes), or when the next token depends
    on which tokens were written rather than prompt (`_BY_OUTPUT`)."""
    text = first.texts.get("text")
    if not first.p_prompt or len(first.p_token) != 1 or not text or "\ufffd" in text:
        return None
    if any(dbody.get(name) not in (None, 0, 0.0, []) for name in _BY_OUTPUT):
        return None
    drop = ("kv_transfer_params", "truncate_prompt_tokens")  # the ids are P's, cut already
    out = {k: v for k, v in dbody.items() if k not in drop}
    out["prompt"] = [*first.p_prompt, *first.p_token]
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


def check_answer(result: legs.LegResult) -> legs.LegResult:
    """P's streamed answer, or the `LegError` of the error event in it (a failure after
    its 200, as vLLM reports one)."""
    for event in _events(result.body):
        code = sse.error_code(event)
        if code is not None:
            detail = event[:500].decode("utf-8", errors="replace")
            payload = event.strip()[5:].strip()  # a 4xx goes to the client as it is
            raise legs.LegError("prefill", "upstream", f"stream failed: {detail}", code, payload)
    return result


@dataclass(frozen=True)
class Head:
    """What the client gets from P: the events, and what of them D's stream repeats."""

    events: bytes  # the role event (chat) and the token's event, as a plain server's
    texts: dict[str, str]  # the token's strings: delta fields (chat) or {"text": ...}
    ids: tuple[int, ...]  # the token ids its event carried (``return_token_ids``)
    # The event carried the prompt's token ids (a completion's ``return_token_ids``):
    # vLLM sends them once, with a choice's first event, so D's copy goes.
    prompt_ids: bool = False
    # P's prompt and token ids, also those taken out of the client's event
    # (`ids_hidden`): what `continue_body` goes on from.
    p_prompt: tuple[int, ...] = ()
    p_token: tuple[int, ...] = ()


def from_answer(data: bytes, chat: bool, hide_ids: bool = False) -> Head | None:
    """The head of P's streamed answer; None when it is not one token that a plain
    server would send as is (it ended for another reason than its length). vLLM's
    detokenizers write a token's text alike whether the request ends with it or not
    (without stop strings, which `eligible` excludes): an empty text (the token is the
    first part of a character, held back) and a text with U+FFFD (bytes that are no
    character, say from a prompt's) are sent as they are; D's copy is the same. With
    `hide_ids`, the token ids in P's event are kept in `p_prompt` and `p_token` and set to
    none in the client's, as a plain server writes them unasked."""
    events = [e for e in _events(data) if not e.startswith(_DONE)]
    out = []
    if chat:
        if not events or "role" not in _delta(_payload(events[0])):
            return None
        out.append(events.pop(0))
    if not events:
        return None
    obj = _payload(events[0])
    choice = _choice(obj)
    if choice is None or choice.get("finish_reason") != "length":
        return None
    fields = _delta(obj) if chat else choice
    keys = set(fields) & _TEXT_FIELDS if chat else {"text"}
    texts = {k: fields[k] for k in keys if isinstance(fields.get(k), str)}
    if chat and set(fields) - _TEXT_FIELDS:
        return None  # a role or tool call beside the text: not one plain token event
    if not texts:
        return None
    choice["finish_reason"] = None
    if chat:
        choice.pop("stop_reason", None)  # a chat chunk has it only when finished
    obj.pop("system_fingerprint", None)  # only on a finished chunk
    p_token, p_prompt = _ints(choice.get("token_ids")), _ints(choice.get("prompt_token_ids"))
    if hide_ids:
        for key in ("token_ids", "prompt_token_ids"):
            if key in choice:
                choice[key] = None
    out.append(_event(obj))
    token_ids = _ints(choice.get("token_ids"))
    prompt_ids = isinstance(choice.get("prompt_token_ids"), list)
    return Head(b"".join(out), texts, token_ids, prompt_ids, p_prompt, p_token)


class Early:
    """P's streamed answer read as it comes (`feed`, each piece): `ready` gets its head
    once P's first events are whole, before P's stream ends ([DONE] and the close of the
    chunked body come a loop turn or more of P's server later, and the whole answer
    waits for them). `from_answer` reads nothing past those events, so it makes the same
    head of them as of the whole answer. When they make none, `ready` stays pending and
    the whole answer decides (an error event in it fails the leg: `check_answer`)."""

    def __init__(self, chat: bool, hide_ids: bool) -> None:
        self.ready: asyncio.Future[Head] = asyncio.get_running_loop().create_future()
        self.content_type = ""  # P's, for the client's headers
        self.chat, self.hide_ids = chat, hide_ids  # `from_answer`'s, also for the whole answer
        self._need = 2 if chat else 1  # whole events: the role's (chat) and the token's
        self._buf: bytearray | None = bytearray()  # None once decided
        self._ends, self._from = 0, 0  # events ended so far; where the last one ended

    def feed(self, piece: bytes, content_type: str) -> None:
        if self._buf is None:
            return
        # Each byte is searched once (the last one again: an end across two pieces).
        start = max(self._from, len(self._buf) - 1)
        self._buf += piece
        if len(self._buf) > _MAX_HEAD:
            self._buf = None  # not P's one-token answer: the whole answer decides
            return
        # An event ends with a blank line, which no JSON text holds unescaped.
        while self._ends < self._need and (end := self._buf.find(_END, start)) >= 0:
            self._ends += 1
            start = self._from = end + len(_END)
        if self._ends < self._need:
            return
        got = from_answer(bytes(self._buf), self.chat, self.hide_ids)
        self._buf = None
        if got is not None:
            self.content_type = content_type
            self.ready.set_result(got)


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not bodies.all_ints(value):
        return ()
    return tuple(value)


class _ByEvent:
    """A stream edited event by event: fed pieces in order, `feed` returns what to pass
    on, each whole event through `_one`, until `done`; from then on pieces pass as they
    are."""

    def __init__(self) -> None:
        self.done = False
        self._buf = b""

    def feed(self, piece: bytes) -> bytes:
        if self.done:
            return piece
        self._buf += piece
        out = []
        while not self.done and (end := self._buf.find(_END)) >= 0:
            event, self._buf = self._buf[: end + len(_END)], self._buf[end + len(_END) :]
            out.append(self._one(event))
        if self.done:
            out.append(self.rest())
        return b"".join(out)

    def rest(self) -> bytes:
        """What is held and not yet a whole event (at the stream's end)."""
        rest, self._buf = self._buf, b""
        return rest

    def _one(self, event: bytes) -> bytes:
        raise NotImplementedError


class Continued(_ByEvent):
    """D's stream of a continuation (`continue_body`) as the rest of the client's: its
    usage counts P's token as written, not as prompt, and its first event loses the
    prompt ids (D's have P's token on them; the client had P's)."""

    def _one(self, event: bytes) -> bytes:
        obj = _payload(event)
        if not isinstance(obj, dict):
            return event  # [DONE], or anything not an event of vLLM's
        changed = False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt, written = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if bodies.is_int(prompt) and bodies.is_int(written) and prompt > 0:
                usage["prompt_tokens"], usage["completion_tokens"] = prompt - 1, written + 1
                changed = True
        choice = _choice(obj)
        if choice is not None and choice.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = None  # as a plain server's later events have it
            changed = True
        return _event(obj) if changed else event


class Trim(_ByEvent):
    """D's stream minus what the client got from P: fed D's pieces in order, it returns
    what to pass on. It drops D's role event (chat) and takes the head's text and token
    ids off the front of D's first token event; once past it, pieces pass as they are."""

    def __init__(self, head: Head, chat: bool) -> None:
        super().__init__()
        self.head, self.chat = head, chat
        self.role_left = chat
        self.mismatch = False  # D's first token was not P's

    def _one(self, event: bytes) -> bytes:
        obj = _payload(event)
        choice = _choice(obj)
        if choice is None:  # an error event, or anything unexpected: passed on
            self.done = True
            return event
        if self.role_left and "role" in _delta(obj):
            self.role_left = False
            return b""
        self.done = True
        fields = _delta(obj) if self.chat else choice
        for key, text in self.head.texts.items():
            got = fields.get(key)
            if isinstance(got, str) and got.startswith(text):
                fields[key] = got[len(text) :]
            else:
                self.mismatch = True
        if self.mismatch:  # the client keeps P's token: D's differing copy goes
            for key in self.head.texts:
                fields[key] = ""
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            if tuple(ids[: len(self.head.ids)]) != self.head.ids:
                self.mismatch = True  # the same text from another token (or none yet)
            del ids[: len(self.head.ids)]
        if self.head.prompt_ids and choice.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = None  # as a plain server's later events have it
        left = any(fields.get(k) for k in self.head.texts) or bool(ids)
        if not left and choice.get("finish_reason") is None:
            return b""
        return _event(obj)


def _events(data: bytes) -> list[bytes]:
    return [e + _END for e in data.split(_END) if e.strip()]


def _payload(event: bytes) -> Any:
    text = event.strip()
    if not text.startswith(b"data:") or text.startswith(_DONE):
        return None
    try:
        return jsonbody.loads(text[5:])  # P's first event holds the prompt's ids: long
    except (ValueError, RecursionError):
        return None


def _choice(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0] if choices[0].get("index") == 0 else None


def _delta(obj: Any) -> dict[str, Any]:
    choice = _choice(obj)
    delta = choice.get("delta") if choice is not None else None
    return delta if isinstance(delta, dict) else {}


def _event(obj: Any) -> bytes:
    # vLLM writes its events compact and UTF-8 (pydantic's JSON): the same here.
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + data.encode() + _END

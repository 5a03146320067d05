"""P's first token to the client (kvpush.router.head): which requests qualify, P's events
as a plain server's, D's stream without its copy; and through the router with stub
upstreams that stream as vLLM does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from kvpush.router import head, legs, sse
from tests.unit.test_router import DEADLINE, running, stub

GREEDY = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "temperature": 0}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_completion_tokens": 8,
    "stream": True,
    "seed": 3,  # greedy with a seed: still P's token
    "temperature": 0,
}


def ev(obj: Any) -> bytes:
    # As vLLM writes its events: compact, UTF-8 (pydantic).
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + data.encode() + b"\n\n"


def text_event(text: str, finish: str | None = None, ids: list[int] | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
    choice.update(finish_reason=finish, stop_reason=None)
    if ids is not None:
        choice["token_ids"] = ids
    return ev({"id": "cmpl-x", "object": "text_completion", "created": 1, "choices": [choice]})


def role_event() -> bytes:
    delta = {"role": "assistant", "content": ""}
    return ev({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def chat_event(content: str, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": content}, "logprobs": None}
    choice["finish_reason"] = finish
    if finish is not None:
        choice["stop_reason"] = None
    obj: dict[str, Any] = {"id": "c", "choices": [choice]}
    if finish is not None:
        obj["system_fingerprint"] = "fp"
    return ev(obj)


DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("change", "chat", "ok"),
    [
        ({}, False, True),
        ({}, True, True),
        ({"temperature": 0.7}, False, False),  # sampled without a seed: D's would differ
        ({"temperature": None}, False, False),  # the server's default: unknown here
        # P's leg has no seed (kvpush.router.bodies): its sampled token is not D's
        ({"temperature": 0.7, "seed": 5}, False, False),
        ({"temperature": 0.7, "seed": 5}, True, False),
        ({"stream": False}, False, False),
        ({"n": 2}, False, False),
        ({"stop": ["x"]}, False, False),
        ({"stop": []}, False, True),
        ({"logprobs": 0}, False, False),
        ({"logprobs": False}, False, False),  # vLLM reads it as 0
        ({"logprobs": False}, True, True),
        ({"echo": True}, False, False),
        ({"max_tokens": 1}, False, False),
        ({"max_tokens": None}, False, True),
        ({"prompt": ["a", "b"]}, False, False),
        ({"prompt": [1, 2, 3]}, False, True),
        ({"prompt": [[1, 2]]}, False, True),
        ({"response_format": {"type": "json_object"}}, False, False),
        ({"tools": [{"type": "function"}]}, True, False),
        ({"logprobs": True}, True, False),
        ({"max_completion_tokens": 1}, True, False),
    ],
)
def test_which_requests_qualify(change: dict[str, Any], chat: bool, ok: bool) -> None:
    body = {**(CHAT if chat else GREEDY), **change}
    assert head.eligible({k: v for k, v in body.items() if v is not None}, chat) is ok


def test_the_prefill_leg_is_streamed_like_the_clients() -> None:
    body = {**GREEDY, "stream_options": {"include_usage": True}, "logprobs": None}
    out = head.prefill_body(body, "t1", chat=False)
    assert out["stream"] is True and out["max_tokens"] == 1
    assert out["stream_options"] == {"include_usage": True}
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": "t1"}
    # A completion's P leg asks for the ids D may go on from; a chat one does not.
    assert out["return_token_ids"] is True
    assert "return_token_ids" not in head.prefill_body(CHAT, "t1", chat=True)
    assert head.ids_hidden(body, chat=False) and not head.ids_hidden(CHAT, chat=True)
    assert not head.ids_hidden({**body, "return_token_ids": True}, chat=False)


def test_ps_completion_token_event_is_sent_as_an_unfinished_one() -> None:
    answer = text_event(" the", "length", [5]) + DONE
    got = head.from_answer(answer, chat=False)
    assert got is not None and got.texts == {"text": " the"} and got.ids == (5,)
    assert got.events == text_event(" the", None, [5])


def test_ps_chat_events_lose_only_what_marks_the_end() -> None:
    usage = ev({"id": "c", "choices": [], "usage": {"completion_tokens": 1}})
    got = head.from_answer(role_event() + chat_event("Hi", "length") + usage + DONE, chat=True)
    assert got is not None
    # The role event as P sent it; the token event without finish, stop reason and
    # fingerprint, as a plain server's unfinished chunk; the usage event is D's to send.
    assert got.events == role_event() + chat_event("Hi")


@pytest.mark.parametrize(
    "answer",
    [
        text_event(" the", "stop") + DONE,  # an end of sequence: D decides alone
        b'data: {"error": {"code": 500}}\n\n' + DONE,
        b"not a stream at all",
        b"data: 5\n\n" + DONE,
        # nested deeper than json's recursion limit: refused, not raised
        b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n" + DONE,
        b'data: {"choices": [{"text": "x", "finish_reason": "length", "token_ids": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}]}\n\n"
        + DONE,
    ],
)
def test_an_answer_that_is_not_one_plain_token_gives_no_head(answer: bytes) -> None:
    assert head.from_answer(answer, chat=False) is None


def test_a_text_with_u_fffd_is_sent_as_p_wrote_it_and_not_gone_on_from() -> None:
    # vLLM writes such a text alike in a finished and an unfinished stream: the client
    # gets P's, D's copy goes; D's continuation would begin its text elsewhere: it
    # computes the request again instead.
    event = text_event("ab\ufffd c", "length", [7])
    h = head.from_answer(with_prompt_ids(event, [1, 2]) + DONE, chat=False)
    assert h is not None and h.texts == {"text": "ab\ufffd c"}
    assert h.events == with_prompt_ids(text_event("ab\ufffd c", None, [7]), [1, 2])
    assert head.Trim(h, chat=False).feed(text_event("ab\ufffd c", None, [7]) + DONE) == DONE
    assert head.continue_body(GREEDY, h) is None


def test_a_token_without_text_yet_is_sent_empty_and_ds_text_passes_whole() -> None:
    # The first part of a character: a plain server sends "" for it, then the character
    # with the next token; D's copy of the empty token goes, its next text passes.
    h = head.from_answer(text_event("", "length", [7]) + DONE, chat=False)
    assert h is not None and h.events == text_event("", None, [7])
    trim = head.Trim(h, chat=False)
    assert trim.feed(text_event("", None, [7]) + text_event("é")) == text_event("é")
    joined = head.Trim(h, chat=False).feed(text_event("é", None, [7, 8]))
    assert joined == text_event("é", None, [8])


def test_a_chat_answer_without_its_role_event_gives_no_head() -> None:
    assert head.from_answer(chat_event("Hi", "length") + DONE, chat=True) is None


def feed_bytewise(trim: head.Trim, data: bytes) -> bytes:
    return b"".join(trim.feed(data[i : i + 1]) for i in range(len(data)))


def test_ds_role_event_and_first_token_are_dropped_in_pieces_of_any_size() -> None:
    h = head.from_answer(role_event() + chat_event("Hi", "length") + DONE, chat=True)
    assert h is not None
    d = role_event() + chat_event("Hi") + chat_event(" there") + chat_event("!", "length") + DONE
    out = feed_bytewise(head.Trim(h, chat=True), d)
    assert out == chat_event(" there") + chat_event("!", "length") + DONE


def test_a_joined_event_loses_only_the_heads_text_and_ids() -> None:
    h = head.from_answer(text_event(" the", "length", [5]) + DONE, chat=False)
    assert h is not None
    trim = head.Trim(h, chat=False)
    out = trim.feed(text_event(" the cat", None, [5, 9]) + text_event(".", "length", [2]))
    assert out == text_event(" cat", None, [9]) + text_event(".", "length", [2])
    assert not trim.mismatch


def test_the_prompts_token_ids_come_once_with_ps_event() -> None:
    """vLLM sends a completion's prompt token ids (``return_token_ids``) with a choice's
    first event only: P's event has them, D's first event has them again (seen in the
    burst e2e test as a prompt twice as long)."""

    def first(text: str, finish: str | None, ids: list[int]) -> bytes:
        event = json.loads(text_event(text, finish, ids)[5:])
        event["choices"][0]["prompt_token_ids"] = [1, 2, 3]
        return ev(event)

    h = head.from_answer(first(" the", "length", [5]) + DONE, chat=False)
    assert h is not None and h.prompt_ids
    trim = head.Trim(h, chat=False)
    out = trim.feed(first(" the cat", None, [5, 9]) + text_event(".", "length", [2]))
    later = json.loads(text_event(" cat", None, [9])[5:])
    later["choices"][0]["prompt_token_ids"] = None
    assert out == ev(later) + text_event(".", "length", [2])
    assert not trim.mismatch


def test_a_differing_first_token_from_d_is_dropped_and_counted() -> None:
    h = head.from_answer(text_event(" the", "length") + DONE, chat=False)
    assert h is not None
    trim = head.Trim(h, chat=False)
    assert trim.feed(text_event(" a") + text_event(" cat")) == text_event(" cat")
    assert trim.mismatch


def test_the_same_text_from_another_token_is_a_differing_first_token() -> None:
    """With token ids asked for, an empty text (the first part of a character) or the
    same text from another token is told apart by its id."""
    h = head.from_answer(text_event("", "length", [5]) + DONE, chat=False)
    assert h is not None
    trim = head.Trim(h, chat=False)
    trim.feed(text_event("", None, [7]) + text_event("é", None, [9]))
    assert trim.mismatch
    same = head.Trim(h, chat=False)
    assert same.feed(text_event("", None, [5]) + text_event("é", None, [9])) == text_event(
        "é", None, [9]
    )
    assert not same.mismatch


def test_an_error_event_from_d_passes_and_ends_trimming() -> None:
    h = head.from_answer(text_event(" the", "length") + DONE, chat=False)
    assert h is not None
    error = b'data: {"error": {"code": 500, "message": "no KV"}}\n\n'
    assert head.Trim(h, chat=False).feed(error + DONE) == error + DONE


def test_an_error_event_nested_too_deep_is_a_server_side_failure() -> None:
    deep = b'data: {"error": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n"
    assert sse.error_code(deep) == 500
    with pytest.raises(legs.LegError) as caught:
        head.check_answer(legs.LegResult(200, text_event(" a", "length") + deep + DONE, ""))
    assert caught.value.leg == "prefill" and caught.value.http_status == 502


def test_an_error_event_in_ps_stream_fails_the_prefill_leg() -> None:
    answer = text_event(" a", "length") + b'data: {"error": {"code": 503}}\n\n' + DONE
    with pytest.raises(legs.LegError) as caught:
        head.check_answer(legs.LegResult(200, answer, "text/event-stream"))
    assert caught.value.leg == "prefill" and caught.value.http_status == 502


# --- through the router ----------------------------------------------------------------


def streams_one_token(seen: dict[str, Any]) -> Any:
    """A prefiller streaming one token (" the") as vLLM ends a max_tokens=1 stream; the
    body it got goes to seen["p"]."""

    async def prefill(request: web.Request) -> web.StreamResponse:
        seen["p"] = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(text_event(" the", "length") + DONE)
        return resp

    return prefill


def client_events(
    prefill: Any, decode: Any, client_has_first: asyncio.Event
) -> tuple[list[bytes], bytes]:
    """A greedy streamed completion through the router over these stub legs: the client's
    events (`client_has_first` set at the first), then the router's /metrics."""

    async def main() -> tuple[list[bytes], bytes]:
        events = []
        async with running(stub(prefill), stub(decode)) as (url, cl):
            async with asyncio.timeout(2 * DEADLINE):
                async with cl.post(url + "/v1/completions", json=GREEDY) as resp:
                    assert resp.status == 200
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            events.append(line + b"\n")
                            client_has_first.set()
                async with cl.get(url + "/metrics") as m:
                    metrics = await m.read()
        return events, metrics

    return asyncio.run(main())


def test_the_client_gets_ps_token_before_d_sends_anything() -> None:
    """D writes nothing until the client has its first event: that event can only be P's.
    Then the client gets D's stream without D's copy of the token."""
    client_has_first = asyncio.Event()
    seen: dict[str, Any] = {}
    prefill = streams_one_token(seen)

    async def decode(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.wait_for(client_has_first.wait(), DEADLINE)
        for event in (text_event(" the"), text_event(" cat"), text_event(".", "length"), DONE):
            await resp.write(event)
        return resp

    events, metrics = client_events(prefill, decode, client_has_first)
    want = [text_event(" the"), text_event(" cat"), text_event(".", "length"), DONE]
    assert events == want
    assert seen["p"]["stream"] is True and seen["p"]["max_tokens"] == 1
    assert b'kvpush_router_first_token_total{leg="prefill",why="p_first"} 1.0' in metrics


@pytest.mark.parametrize(
    ("p_answer", "d_first", "why"),
    [
        (text_event(" the", "length") + DONE, False, "p_first"),
        (text_event(" the", "length") + DONE, True, "d_first"),  # both in: D's wins
        (text_event(" the", "stop") + DONE, False, "p_unusable"),  # not ended by its length
        (b"data: [1]\n\n" + DONE, False, "p_unusable"),  # not an event of vLLM's
        (None, False, "p_failed"),
    ],
)
def test_the_first_token_says_whose_it_is_and_why(
    p_answer: bytes | None, d_first: bool, why: str
) -> None:
    """`streaming._first_of` with P's leg settled: its answer (None: the leg failed) and,
    with `d_first`, D's first chunk in already; else D's comes after the choice."""
    from kvpush.router import streaming

    async def main() -> tuple[Any, str]:
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[Any] = loop.create_future()
        answered: asyncio.Future[Any] = loop.create_future()
        if p_answer is None:
            answered.set_exception(legs.LegError("prefill", "upstream", "HTTP 500", 500))
        else:
            answered.set_result(legs.LegResult(200, p_answer, "text/event-stream"))
        if d_first:
            opened.set_result(("d", b"d's first"))
        early = head.Early(False, False)  # fed nothing: the whole answer decides
        first = asyncio.create_task(streaming._first_of(opened, answered, early))  # type: ignore[arg-type]
        # No timer and no I/O: the loop runs the ready callbacks in order, so by these
        # passes _first_of has looked at both legs and, unless P's answer did, waits on D's.
        for _ in range(10):
            await asyncio.sleep(0)
        assert first.done() == (why in ("p_first", "d_first"))
        if not opened.done():
            opened.set_result(("d", b"d's first"))
        return await first

    got, said = asyncio.run(main())
    assert said == why
    assert isinstance(got, head.Head) == (why == "p_first")
    assert said in streaming.FIRST_WHY


def decodes_after(client_has_first: asyncio.Event) -> Any:
    """A decoder that streams " the" (P's copy), "." and the end once the client has its
    first event: that event can only be P's."""

    async def decode(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.wait_for(client_has_first.wait(), DEADLINE)
        await resp.write(text_event(" the") + text_event(".", "length") + DONE)
        return resp

    return decode


def test_ps_head_goes_to_the_client_before_ps_stream_ends() -> None:
    """P writes its token's event and ends its stream only once the client has that
    event: the router takes P's head from the pieces as they come (`head.Early`)."""
    client_has_first = asyncio.Event()

    async def prefill(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(text_event(" the", "length"))
        await asyncio.wait_for(client_has_first.wait(), DEADLINE)
        await resp.write(DONE)
        return resp

    events, metrics = client_events(prefill, decodes_after(client_has_first), client_has_first)
    assert events == [text_event(" the"), text_event(".", "length"), DONE]
    assert b'kvpush_router_first_token_total{leg="prefill",why="p_first"} 1.0' in metrics


@pytest.mark.parametrize("chat", [False, True])
def test_early_makes_of_ps_first_events_the_head_of_the_whole_answer(chat: bool) -> None:
    """Fed in pieces of any size, `Early` decides once P's first events are whole, and
    decides as `from_answer` does on the whole answer; its pieces after that change
    nothing."""
    first = [role_event(), chat_event("Hi", "length")] if chat else [text_event("Hi", "length")]
    answers = [b"".join(first) + DONE, first[0] + b"data: [1]\n\n" + DONE]
    answers.append(b'data: {"error": {"code": 500}}\n\n' + DONE)

    async def main() -> None:
        for answer in answers:
            whole = head.from_answer(answer, chat)
            for size in (1, 7, len(answer)):
                early = head.Early(chat, False)
                for i in range(0, len(answer), size):
                    early.feed(answer[i : i + size], "text/event-stream")
                got = early.ready.result() if early.ready.done() else None
                assert got == whole, (answer, size)
                assert early.content_type == ("text/event-stream" if got else "")

    asyncio.run(main())


def test_early_gives_up_on_an_answer_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer that has not ended its first events within `_MAX_HEAD` bytes is left to
    the whole answer, however it is cut into pieces."""
    monkeypatch.setattr(head, "_MAX_HEAD", 64)
    event = text_event("x" * 80, "length")  # one event longer than the bound

    async def main() -> None:
        early = head.Early(False, False)
        for i in range(len(event)):
            early.feed(event[i : i + 1], "text/event-stream")
        early.feed(DONE, "text/event-stream")
        assert not early.ready.done()

    asyncio.run(main())


def test_traced_the_router_marks_ps_first_piece_head_and_whole_answer(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpush.core import trace

    monkeypatch.setattr(trace, "ON", True)
    monkeypatch.setattr(trace, "DIR", str(tmp_path))
    monkeypatch.setattr(trace, "_out", None)
    client_has_first = asyncio.Event()

    try:
        client_events(streams_one_token({}), decodes_after(client_has_first), client_has_first)
    finally:
        if trace._out is not None:
            trace._out.close()
    marks = {str(e["ev"]): float(e["t"]) for e in trace.read(str(tmp_path))}  # type: ignore[arg-type]
    assert marks["router.recv"] <= marks["router.p_piece"] <= marks["router.p_head"]
    assert marks["router.p_head"] <= marks["router.prepared"]
    assert marks["router.p_piece"] <= marks["router.p_answer"]


def test_a_decoder_that_fails_after_ps_token_ends_the_stream_with_an_error_event() -> None:
    prefill = streams_one_token({})
    p_answered = asyncio.Event()

    async def decode(request: web.Request) -> web.Response:
        await asyncio.wait_for(p_answered.wait(), DEADLINE)
        return web.json_response({"error": "engine dead"}, status=500)

    lines, _ = client_events(prefill, decode, p_answered)
    events = [line[6:].strip() for line in lines]
    assert json.loads(events[0])["choices"][0]["text"] == " the"
    error = json.loads(events[1])["error"]
    assert error["leg"] == "decode" and error["code"] == 502
    assert events[2:] == [b"[DONE]"]


def test_ds_request_again_has_no_kv_of_ps_and_its_own_cache_salt() -> None:
    dbody = {**GREEDY, "cache_salt": "mine", "kv_transfer_params": {"do_remote_prefill": True}}
    again = head.again_body(dbody, "t1")
    assert "kv_transfer_params" not in again
    assert again["cache_salt"] == "kvpush-again-t1"
    assert {k: v for k, v in again.items() if k != "cache_salt"} == GREEDY
    assert "kv_transfer_params" in dbody  # the decode leg's body is left as it was


def answers_twice(firsts: tuple[str, str], seen: list[dict[str, Any]]) -> tuple[Any, asyncio.Event]:
    """A decoder whose n-th answer starts with firsts[n] and goes on " dog", "."; the
    bodies it got go to `seen`. Its first answer waits until the client has an event,
    which can then only be P's."""
    client_has_first = asyncio.Event()

    async def decode(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        first = firsts[len(seen) - 1]
        if len(seen) == 1:
            await asyncio.wait_for(client_has_first.wait(), DEADLINE)
        for event in (text_event(first), text_event(" dog"), text_event(".", "length"), DONE):
            await resp.write(event)
        return resp

    return decode, client_has_first


def test_a_differing_first_token_from_d_makes_d_compute_the_request_again() -> None:
    """D's continuation would follow its own first token, not the client's: the router
    drops that stream and relays D's answer to the request asked again without P's KV."""
    seen: list[dict[str, Any]] = []
    events, metrics = client_events(streams_one_token({}), *answers_twice((" a", " the"), seen))
    assert events == [text_event(" the"), text_event(" dog"), text_event(".", "length"), DONE]
    assert len(seen) == 2
    assert "kv_transfer_params" in seen[0] and "cache_salt" not in seen[0]
    assert "kv_transfer_params" not in seen[1] and seen[1]["cache_salt"].startswith("kvpush-")
    assert b"kvpush_router_first_token_mismatch_total 1.0" in metrics


def test_a_first_token_that_differs_twice_ends_the_stream_with_an_error_event() -> None:
    seen: list[dict[str, Any]] = []
    events, _ = client_events(streams_one_token({}), *answers_twice((" a", " a"), seen))
    assert len(seen) == 2
    assert events[0] == text_event(" the")
    error = json.loads(events[1][6:])["error"]
    assert error["leg"] == "decode" and "twice" in error["message"]
    assert events[2:] == [DONE]


def with_prompt_ids(event: bytes, ids: list[int] | None) -> bytes:
    obj = json.loads(event[5:])
    obj["choices"][0]["prompt_token_ids"] = ids
    return ev(obj)


def test_ids_the_client_did_not_ask_for_are_kept_for_d_and_hidden_from_the_client() -> None:
    """P's leg asks for token ids (`prefill_body`); unasked, the client's event has them
    as a plain server writes them unasked (null), and the head keeps P's for D."""
    answer = with_prompt_ids(text_event(" the", "length", [5]), [1, 2, 3]) + DONE
    h = head.from_answer(answer, chat=False, hide_ids=True)
    assert h is not None and (h.p_prompt, h.p_token) == ((1, 2, 3), (5,))
    assert h.ids == () and not h.prompt_ids  # D's stream (unasked) has none to take off
    plain = json.loads(with_prompt_ids(text_event(" the", None, [5]), [1, 2, 3])[5:])
    plain["choices"][0].update(token_ids=None, prompt_token_ids=None)
    assert h.events == ev(plain)
    asked = head.from_answer(answer, chat=False)
    assert asked is not None and asked.ids == (5,) and asked.prompt_ids
    assert (asked.p_prompt, asked.p_token) == ((1, 2, 3), (5,))


def test_d_goes_on_from_ps_token_with_one_token_fewer() -> None:
    answer = with_prompt_ids(text_event(" the", "length", [5]), [1, 2, 3]) + DONE
    h = head.from_answer(answer, chat=False, hide_ids=True)
    assert h is not None
    dbody = {**GREEDY, "min_tokens": 2, "truncate_prompt_tokens": 3, "cache_salt": "s"}
    dbody["kv_transfer_params"] = {"do_remote_prefill": True}
    onward = head.continue_body(dbody, h)
    assert onward is not None
    assert onward["prompt"] == [1, 2, 3, 5] and onward["max_tokens"] == 7
    assert onward["min_tokens"] == 1 and onward["cache_salt"] == "s"
    assert "kv_transfer_params" not in onward and "truncate_prompt_tokens" not in onward
    assert dbody["prompt"] == "hello" and "kv_transfer_params" in dbody  # left as it was
    no_max = head.continue_body({k: v for k, v in GREEDY.items() if k != "max_tokens"}, h)
    assert no_max is not None and "max_tokens" not in no_max  # vLLM's default: one fewer
    # Without P's ids, or with a token that has no text of its own: computed again.
    bare = head.from_answer(text_event(" the", "length") + DONE, chat=False)
    assert bare is not None and head.continue_body(GREEDY, bare) is None
    empty = head.from_answer(with_prompt_ids(text_event("", "length", [7]), [1]) + DONE, False)
    assert empty is not None and head.continue_body(GREEDY, empty) is None
    # Ids of the wrong type in P's answer (not a list of ints, or a bool): none taken.
    wrong: list[tuple[Any, Any]] = [([1, "2"], [5]), ({"a": 1}, [5]), ([1], [True]), ([1], [5, 6])]
    wrong += [([1, 2.0], [5]), ([1, False], [5]), ([1, None], [5]), ([[1]], [5]), ([1], [5.0])]
    for bad_prompt, bad_token in wrong:
        odd = with_prompt_ids(text_event(" the", "length", bad_token), bad_prompt)
        got = head.from_answer(odd + DONE, chat=False, hide_ids=True)
        assert got is not None and head.continue_body(GREEDY, got) is None, (bad_prompt, bad_token)


def test_a_continuations_usage_counts_ps_token_as_written() -> None:
    """D's prompt has P's token on it: its usage moves one token from prompt to written,
    in every event that has usage, and D's prompt ids (the client had P's) go."""
    first = with_prompt_ids(text_event(" cat", None, [9]), [1, 2, 3, 5])
    usage = ev(
        {
            "id": "cmpl-x",
            "choices": [],
            "usage": {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11},
        }
    )
    stream = first + text_event(".", "length", [2]) + usage + DONE
    edit = head.Continued()
    out = b"".join(edit.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + edit.rest()
    want_first = with_prompt_ids(text_event(" cat", None, [9]), None)
    want_usage = ev(
        {
            "id": "cmpl-x",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11},
        }
    )
    assert out == want_first + text_event(".", "length", [2]) + want_usage + DONE


def streams_one_token_with_ids(seen: dict[str, Any]) -> Any:
    """A prefill server that streams P's token with the ids its leg asked for."""

    async def prefill(request: web.Request) -> web.StreamResponse:
        seen["p"] = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = with_prompt_ids(text_event(" the", "length", [5]), [1, 2, 3])
        await resp.write(event + DONE)
        return resp

    return prefill


def test_a_differing_first_token_from_d_makes_d_go_on_from_ps_token() -> None:
    """With P's ids, D is asked to go on from P's token (the prompt's ids and P's token,
    one token fewer), and its answer, whose first token is the second, follows the
    client's first; the client never sees an id it did not ask for."""
    seen: list[dict[str, Any]] = []
    p_seen: dict[str, Any] = {}
    decode, has_first = answers_twice((" a", " dog"), seen)
    events, metrics = client_events(streams_one_token_with_ids(p_seen), decode, has_first)
    assert p_seen["p"]["return_token_ids"] is True
    first = json.loads(events[0][6:])["choices"][0]
    assert first["text"] == " the" and first["token_ids"] is None
    assert first["prompt_token_ids"] is None
    # D's second answer (stub) writes " dog", " dog", "."; all of it follows P's token.
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[1:-1]] == [" dog", " dog", "."]
    assert events[-1] == DONE
    assert len(seen) == 2 and seen[1]["prompt"] == [1, 2, 3, 5]
    assert seen[1]["max_tokens"] == GREEDY["max_tokens"] - 1
    assert "kv_transfer_params" not in seen[1] and "cache_salt" not in seen[1]
    assert b"kvpush_router_first_token_mismatch_total 1.0" in metrics


def test_penalties_on_written_tokens_keep_the_whole_prompt_compute() -> None:
    """Frequency and presence penalties (and bad words) count written tokens only: with
    P's token in D's prompt, D's next token could differ from a plain server's."""
    answer = with_prompt_ids(text_event(" the", "length", [5]), [1, 2, 3]) + DONE
    h = head.from_answer(answer, chat=False, hide_ids=True)
    assert h is not None
    assert head.continue_body({**GREEDY, "presence_penalty": 0}, h) is not None
    for field, value in (
        ("frequency_penalty", 0.5),
        ("presence_penalty", -1),
        ("bad_words", ["x"]),
    ):
        assert head.continue_body({**GREEDY, field: value}, h) is None, field


def test_a_continuation_d_refuses_falls_back_to_the_whole_prompt() -> None:
    """Should D refuse the continuation (a 4xx: say, a prompt one token too long for its
    model length), D computes the request again from the whole prompt instead."""
    seen: list[dict[str, Any]] = []
    client_has_first = asyncio.Event()

    async def decode(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        if len(seen) == 2:
            return web.json_response({"error": {"message": "too long", "code": 400}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(seen) == 1:
            await asyncio.wait_for(client_has_first.wait(), DEADLINE)
        first = " a" if len(seen) == 1 else " the"
        for event in (text_event(first), text_event(" dog"), text_event(".", "length"), DONE):
            await resp.write(event)
        return resp

    events, _ = client_events(streams_one_token_with_ids({}), decode, client_has_first)
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == [" the", " dog", "."]
    assert len(seen) == 3 and isinstance(seen[1]["prompt"], list)
    assert seen[2]["prompt"] == GREEDY["prompt"] and seen[2]["cache_salt"].startswith("kvpush-")

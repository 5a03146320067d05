"""The decoder-alone path: a request P cannot help with (`reason`) goes to a decoder as
the client sent it, and the client gets D's answer, whatever it is (`serve`)."""

from __future__ import annotations

import logging

from aiohttp import web

from kvpush.router import bodies, boundary, info, jsonbody, legs, replies, sse
from kvpush.router.call import Call
from kvpush.router.tracking import timed, using

log = logging.getLogger("kvpush.router.app")


async def reason(call: Call) -> str | None:
    """Why the request goes to the decoder alone (a metrics label), or None to split it."""
    ctype = call.request.headers.get("Content-Type")
    if call.body is boundary.NOT_JSON:
        return "not_json"
    if ctype is None or not _json_type(ctype):
        return "content_type"  # vLLM refuses it: D answers as a plain server does
    if not isinstance(call.body, dict):
        return "not_an_object"
    if bodies.vllm_refuses_params(call.body):  # left as sent by `app._read`
        return "bad_kv_transfer_params"
    limit = await info.known_max_model_len(call.app, call.headers)
    return bodies.decoder_alone(call.body, call.chat, limit)


def _json_type(ctype: str) -> bool:
    """A Content-Type vLLM reads as JSON (FastAPI: application/json or */*+json)."""
    mime = ctype.split(";", 1)[0].strip().lower()
    return mime.startswith("application/") and (
        mime == "application/json" or mime.endswith("+json")
    )


async def serve(call: Call, why: str) -> web.StreamResponse:
    """The request to a decoder, as sent; its answer, whatever it is."""
    call.metrics.decoder_alone(why)
    log.debug("transfer %s: to the decoder alone (%s)", call.tid, why)
    ctype = call.request.headers.get("Content-Type")
    call.headers["Content-Type"] = ctype if ctype is not None else ""  # (vLLM: as none)
    d = call.d = call.pool.choose("decode")
    if d is None:
        return replies.none_available(call, "decode")
    # An object is written from what was read, less the client's kv_transfer_params
    # (but for one vLLM refuses for them); only what has no fields (not JSON, not an
    # object) goes as the client sent it.
    data = jsonbody.dump(call.body) if isinstance(call.body, dict) else call.raw
    metrics, timeout = call.metrics, call.timeout
    with using(metrics, d) as verdict:
        try:
            url = d.url + call.path
            upstream = await legs.open_stream(
                call.upstreams, "decode", url, data, call.headers, timeout, any_status=True
            )
        except legs.LegError as err:
            verdict.judge(err)
            return replies.leg_failed(call, err)
        ok = False
        try:
            ctype = upstream.headers.get("Content-Type", "application/json")
            out_headers = {"Content-Type": ctype, "X-Request-Id": call.tid}
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await timed(metrics, d, legs.read_all(upstream, "decode", timeout))
                except legs.LegError as err:
                    verdict.judge(err)
                    return replies.leg_failed(call, err)
                ok = verdict.ok = upstream.status < 500
                if not ok:
                    verdict.failed = "upstream"
                return web.Response(body=data, status=upstream.status, headers=out_headers)
            out = web.StreamResponse(
                status=upstream.status, headers={**out_headers, "Cache-Control": "no-cache"}
            )
            client = sse.chunked_to(call.request, out)
            await out.prepare(call.request)
            copy = sse.pump(upstream, out, "decode", timeout, client=client)
            ok = verdict.ok = await replies.relayed(call, out, timed(metrics, d, copy), verdict)
            if ok:
                await replies.end(out)
            return out
        finally:
            upstream.release() if ok else upstream.close()

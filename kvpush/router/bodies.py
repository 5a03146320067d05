"""What the router sends each leg: the client's body turned into a prefill or decode leg.

Every leg starts from the client's body less its own ``kv_transfer_params`` (`untrusted`):
only the router sets them.

The decode leg is the client's request as sent, plus ``kv_transfer_params``: D validates,
samples and answers exactly as one plain server would, with P's KV instead of its own
prefill. The prefill leg keeps everything that shapes the prompt (prompt or messages and
every chat-template field, tools, truncation, ``n``) and asks for one token, not streamed;
it drops the fields that would make P compute more for that token (``_NOT_FOR_P``): P
computes the prompt's KV and one token that nobody reads, and pushes the KV.

``n`` stays on P: vLLM runs each of the ``n`` samples as its own engine request with its
own blocks, so D needs one push per sample (into the blocks D's prefix cache lacks), and
P's engine gives each sample its own prefill (from its cache where it can), as one plain
server computes it. The connector keys each
sub-request's push by its prompt and sample index (``kvpush.vllm.scheduler_side``).
"""

from __future__ import annotations

from typing import Any, TypeGuard

from kvpush.core import seal
from kvpush.core.secret import Secret

# Fields P does not get: they would make it compute logprobs or compile a grammar for a
# token nobody reads, or conflict with max_tokens=1 and stream=False (min_tokens,
# stream_options). Every other field goes to P as sent, also those that only shape the
# output (stop, logit_bias, bad_words, allowed_token_ids...): they cost P nothing for
# one token, and P then refuses what D refuses, instead of prefilling a request D has
# refused and holding its blocks for a push that never comes.
_NOT_FOR_P = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "min_tokens",
    "stream_options",
    # P's token is never the client's unless greedy (kvpush.router.head), so a seed buys
    # P nothing, and it would give the request a generator of its own: vLLM rewinds that
    # generator after every step that samples a token it throws away (a prompt computed
    # over several steps), which the CPU build cannot do (``CPU Generator does not use
    # offset``; engine dead). P's all-prefill steps hit that under any burst. A seed
    # vLLM would refuse sends the request to D alone (``_doubtful``).
    "seed",
)
# Structured output shapes only a completion's output; a chat template may render
# response_format into the prompt, so chat keeps it.
_NOT_FOR_P_COMPLETIONS = ("response_format", "structured_outputs")
# vLLM's default --max-logprobs: more is refused unless the server allows it.
_MAX_LOGPROBS = 20
# The field the connectors act on. vLLM also reads it from ``vllm_xargs`` (its extra
# sampling args) when the request has no top-level one: a client's there is dropped too.
KV_PARAMS = "kv_transfer_params"
_XARGS = "vllm_xargs"
# What vLLM's extra args take as a value, or as a list's items (JSON's true is an int).
_XARG_SCALARS = (str, int, float)


def vllm_refuses_params(body: dict[str, Any]) -> bool:
    """Whether vLLM refuses this body for its ``kv_transfer_params`` (400): one that is
    neither an object nor null, or one in ``vllm_xargs`` of a type vLLM's extra args
    do not take (an object, a null, a list holding either). Dropping such a value would
    turn a request a plain server refuses into one the router serves; such a body goes
    to D as sent, for vLLM's own 400 (its schema refuses it before anything acts on it)."""
    value = body.get(KV_PARAMS)
    if value is not None and not isinstance(value, dict):
        return True
    xargs = body.get(_XARGS)
    if not isinstance(xargs, dict) or KV_PARAMS not in xargs:
        return False
    value = xargs[KV_PARAMS]
    if isinstance(value, list):
        return not all(isinstance(v, _XARG_SCALARS) for v in value)
    return not isinstance(value, _XARG_SCALARS)


def untrusted(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body without any ``kv_transfer_params`` of its own: only the router
    sets them (each leg's, below). A client's would be the connector's orders: connect
    to a host it names, expect KV it never gets. Every path to an upstream (split legs,
    D alone, a retry, D's re-computation, P's first-token leg) starts from this body."""
    xargs = body.get(_XARGS)
    if KV_PARAMS not in body and not (isinstance(xargs, dict) and KV_PARAMS in xargs):
        return body
    out = {k: v for k, v in body.items() if k != KV_PARAMS}
    if isinstance(xargs, dict) and KV_PARAMS in xargs:
        out[_XARGS] = {k: v for k, v in xargs.items() if k != KV_PARAMS}
    return out


def prefill_body(body: dict[str, Any], transfer_id: str, chat: bool) -> dict[str, Any]:
    """The client body turned into the prefill leg: one token, no stream, push to D."""
    drop = _NOT_FOR_P if chat else _NOT_FOR_P + _NOT_FOR_P_COMPLETIONS
    out = {k: v for k, v in body.items() if k not in drop}
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return out


def decode_body(
    body: dict[str, Any],
    transfer_id: str,
    side_channel: tuple[str, int] | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The client body turned into the decode leg: expects P's KV for `transfer_id`."""
    params: dict[str, Any] = dict(extra or {})
    params.update({"do_remote_prefill": True, "transfer_id": transfer_id})
    if side_channel is not None:
        params["remote_host"], params["remote_port"] = side_channel
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def seal_params(leg: dict[str, Any], secret: Secret | None) -> None:
    """With a params secret, the leg's ``kv_transfer_params`` sealed in place (the leg is
    the router's own copy): P and D with that secret act on sealed params only."""
    if secret is not None:
        leg[KV_PARAMS] = seal.seal(leg[KV_PARAMS], secret)


def decoder_alone(body: dict[str, Any], chat: bool, max_model_len: int | None = None) -> str | None:
    """Why this request must be served by the decoder alone, without P; None to split it.

    - prompt logprobs (``prompt_logprobs``, or ``echo`` with logprobs): they need the
      logits of every prompt position, which only a local prefill computes; vLLM refuses
      external KV for such a request (``skip_reading_prefix_cache``), so D would compute
      the prompt anyway and P's push would wait for nobody;
    - beam search: vLLM runs it as a series of new engine requests without the legs'
      ``kv_transfer_params``, so nothing of P's would be used;
    - prompt embeddings: the connector counts prompt tokens, an embedding prompt has none;
    - a field P does not get looks like one vLLM refuses (``_doubtful``): D's answer is
      the one a plain server gives, and P must not prefill a request D refuses.
    """
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if body.get("echo"):
        # vLLM: echo asks for prompt logprobs at the output's logprobs setting.
        if chat and body.get("top_logprobs", 0) is not None:
            return "prompt_logprobs"
        if not chat and body.get("logprobs") is not None:
            return "prompt_logprobs"
    if body.get("use_beam_search") is True:
        return "beam_search"
    if body.get("prompt_embeds") is not None:
        return "prompt_embeds"
    if _doubtful(body, chat, max_model_len):
        return "doubtful_field"
    return None


def is_int(value: Any) -> TypeGuard[int]:
    """An int that is not a bool (JSON's true is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def all_ints(values: list[Any]) -> bool:
    """Every item an int, not a bool: for token ids, thousands to a prompt, so one exact
    type check each rather than a call to `is_int`."""
    return set(map(type, values)) <= {int}


def _doubtful(body: dict[str, Any], chat: bool, max_model_len: int | None) -> bool:
    """A shape check of the fields P does not get (or gets changed: the output length),
    looser than vLLM's: whatever it lets through, vLLM's own rules for these fields
    accept (checked by the e2e matrix). A request it stops is still answered right, by D
    alone."""
    if body.get("stream_options") is not None and body.get("stream") is not True:
        return True
    for name in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        limit = body.get(name)
        least = 0 if body.get("echo") and not chat else 1
        if limit is not None and not (is_int(limit) and least <= limit <= (max_model_len or limit)):
            return True
    count = body.get("top_logprobs" if chat else "logprobs")
    if count is not None and not (is_int(count) and 0 <= count <= _MAX_LOGPROBS):
        return True
    if chat and (
        body.get("logprobs") not in (None, True, False)
        or (body.get("top_logprobs") and body.get("logprobs") is not True)
    ):
        return True
    if body.get("logprob_token_ids") is not None and not body.get("logprobs"):
        return True
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and -(2**63) <= seed < 2**63):
        return True
    fewest = body.get("min_tokens")
    most = body.get("max_completion_tokens") if chat else None
    most = body.get("max_tokens") if most is None else most
    if fewest is not None and not (is_int(fewest) and fewest >= 0):
        return True
    if isinstance(fewest, int) and isinstance(most, int) and fewest > most:
        return True
    if chat:
        return False
    structured = body.get("structured_outputs")
    if structured is not None and not (
        isinstance(structured, dict)
        and sum(structured.get(k) is not None for k in ("json", "regex", "choice")) <= 1
    ):
        return True
    form = body.get("response_format")
    return form is not None and not (
        isinstance(form, dict)
        and form.get("type") in ("text", "json_object", "json_schema")
        and (form.get("type") != "json_schema" or form.get("json_schema") is not None)
    )

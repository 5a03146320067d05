"""What the router sends each leg: the client's body turned into a prefill or decode leg.

The decode leg is the client's request as sent, plus ``kv_transfer_params``: D validates,
samples and answers exactly as one plain server would, with P's KV instead of its own
prefill. The prefill leg keeps everything that shapes the prompt (prompt or messages and
every chat-template field, tools, truncation, ``n``) and drops what only shapes the output:
P computes the prompt's KV and one token that nobody reads, and pushes the KV.

``n`` stays on P: vLLM runs each of the ``n`` samples as its own engine request with its
own blocks (prefix caching off), so D needs one push per sample, and P's engine gives each
sample its own prefill, as one plain server computes it. The connector keys each
sub-request's push by its prompt and sample index (``kvpush.vllm.scheduler_side``).
"""

from __future__ import annotations

from typing import Any

# Output-only fields: on P they would compute logprobs, grammars or stop checks for a
# token that is thrown away, or conflict with max_tokens=1 (min_tokens, stream_options).
_OUTPUT_ONLY = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "echo",
    "logit_bias",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
    "stream_options",
    "stream_interval",
    "return_token_ids",
    "return_tokens_as_token_ids",
)
# Structured output shapes only a completion's output; a chat template may render
# response_format into the prompt, so chat keeps it.
_COMPLETION_OUTPUT_ONLY = ("response_format", "structured_outputs")


def prefill_body(body: dict[str, Any], transfer_id: str, chat: bool) -> dict[str, Any]:
    """The client body turned into the prefill leg: one token, no stream, push to D."""
    drop = _OUTPUT_ONLY if chat else _OUTPUT_ONLY + _COMPLETION_OUTPUT_ONLY
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


def decoder_alone(body: dict[str, Any], chat: bool) -> str | None:
    """Why this request must be served by the decoder alone, without P; None to split it.

    - prompt logprobs (``prompt_logprobs``, or ``echo`` with logprobs): they need the
      logits of every prompt position, which only a local prefill computes; vLLM refuses
      external KV for such a request (``skip_reading_prefix_cache``), so D would compute
      the prompt anyway and P's push would wait for nobody;
    - beam search: vLLM runs it as a series of new engine requests without the legs'
      ``kv_transfer_params``, so nothing of P's would be used;
    - prompt embeddings: the connector counts prompt tokens, an embedding prompt has none.
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
    return None

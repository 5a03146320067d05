"""The request matrix of tests/e2e/test_router_api.py, built from the fields of vLLM 0.32's
``CompletionRequest`` and ``ChatCompletionRequest`` (vllm/entrypoints/openai/*/protocol.py).

Each case is one request body; the test sends it to one plain vLLM server and through the
router, and compares. Greedy where the output must match token for token; sampling cases
carry a seed (vLLM gives sample j of n the seed + j, on both servers alike)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Case:
    name: str
    path: str
    body: dict[str, Any]
    refused: bool = False  # the plain server refuses it (4xx): same status and body expected
    raw: bytes | None = None  # sent as is instead of `body` ("@MODEL@" becomes the model)
    tags: set[str] = field(default_factory=set)

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 900 + 20 for i in range(n)]


PROMPT = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex"
LONG = ids(300, 5)  # more than two 128-token blocks
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
SAMPLING = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "seed": 1234}
MESSAGES = [{"role": "user", "content": "tell me about silver moons and rivers"}]
TURNS = [
    {"role": "system", "content": "you are a terse assistant"},
    {"role": "user", "content": "name a river"},
    {"role": "assistant", "content": "the silver river"},
    {"role": "user", "content": "and a moon?"},
]


def completion(name: str, refused: bool = False, **body: Any) -> Case:
    body.setdefault("prompt", PROMPT)
    body.setdefault("max_tokens", 6)
    if "n" not in body and "seed" not in body:
        body.setdefault("temperature", 0)
    return Case(name, COMPLETIONS, body, refused)


def chat(name: str, refused: bool = False, **body: Any) -> Case:
    body.setdefault("messages", MESSAGES)
    body.setdefault("max_completion_tokens", 6)
    if "n" not in body and "seed" not in body:
        body.setdefault("temperature", 0)
    return Case(name, CHAT, body, refused)


USAGE = {"include_usage": True}
CASES = [
    # --- completions: prompts
    completion("greedy"),
    completion("token_ids_prompt", prompt=LONG),
    completion("several_prompts", prompt=[PROMPT, "a b c", "silver moons " * 30]),
    completion("several_token_id_prompts", prompt=[ids(40, 1), ids(200, 2), ids(7, 3)]),
    completion("default_max_tokens", max_tokens=None),
    completion("truncate_prompt_tokens", prompt=LONG, truncate_prompt_tokens=100),
    # --- completions: n and seeds
    completion("n_with_seed", n=3, **SAMPLING),
    completion("several_prompts_n_with_seed", prompt=[ids(30, 9), ids(150, 4)], n=2, **SAMPLING),
    completion("seeded_sampling", **SAMPLING),
    completion("best_of", best_of=3, n=2, **SAMPLING),  # not a 0.32 completion field: ignored
    completion(
        "penalties",
        seed=9,
        temperature=0.7,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        max_tokens=12,
    ),
    # --- completions: logprobs
    completion("logprobs", logprobs=3),
    completion("logprobs_several_prompts_n", prompt=[PROMPT, "a b"], n=2, logprobs=2, **SAMPLING),
    completion("echo", echo=True),
    completion("echo_logprobs", echo=True, logprobs=2),
    completion("echo_max_tokens_0", echo=True, max_tokens=0),
    completion("prompt_logprobs", prompt_logprobs=2),
    completion("return_token_ids", return_token_ids=True, prompt=[PROMPT, "a b c"]),
    completion("return_tokens_as_token_ids", logprobs=1, return_tokens_as_token_ids=True),
    # --- completions: stopping and shaping
    completion("stop_strings", stop=[" ", "e"], max_tokens=16),
    completion("stop_strings_included", stop=["e"], include_stop_str_in_output=True),
    completion("stop_token_ids", stop_token_ids=list(range(100, 700)), max_tokens=16),
    completion("min_tokens", stop_token_ids=list(range(100, 700)), min_tokens=5, max_tokens=9),
    completion("ignore_eos", ignore_eos=True, max_tokens=24),
    completion("logit_bias", logit_bias={"321": 100}),
    completion("allowed_token_ids", allowed_token_ids=[30, 31, 32, 33]),
    completion("bad_words", bad_words=["the", "a"]),
    completion("skip_special_tokens_off", skip_special_tokens=False),
    completion("structured_choice", structured_outputs={"choice": ["yes", "no", "maybe"]}),
    completion("structured_regex", structured_outputs={"regex": "[a-c]{2}[0-9]{3}"}),
    completion("response_format_json", response_format={"type": "json_object"}, max_tokens=10),
    completion("beam_search", use_beam_search=True, n=2, max_tokens=4),
    completion("user_and_priority", user="someone", priority=0),
    completion(
        "truncation_side_left", prompt=LONG, truncate_prompt_tokens=50, truncation_side="left"
    ),
    completion("no_special_tokens", add_special_tokens=False, spaces_between_special_tokens=False),
    completion("request_id_field", request_id="client-chosen-id"),
    completion("cache_salt", cache_salt="tenant-a"),
    completion("vllm_xargs", vllm_xargs={"anything": 1}),
    completion("client_kv_transfer_params", kv_transfer_params={"do_remote_decode": True}),
    # --- completions: streams
    completion("stream", stream=True, max_tokens=10),
    completion("stream_usage", stream=True, stream_options=USAGE),
    completion(
        "stream_continuous_usage",
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    ),
    completion(
        "stream_several_prompts_n",
        stream=True,
        prompt=[ids(20, 10), ids(130, 6)],
        n=2,
        stream_options=USAGE,
        **SAMPLING,
    ),
    completion("stream_logprobs", stream=True, logprobs=2),
    completion("stream_echo_logprobs", stream=True, echo=True, logprobs=1),
    completion("stream_stop", stream=True, stop=["e"], max_tokens=16),
    # --- chat
    chat("chat"),
    chat("chat_system_multi_turn", messages=TURNS),
    chat("chat_max_tokens_only", max_completion_tokens=None, max_tokens=7),
    chat("chat_logprobs", logprobs=True, top_logprobs=3),
    chat("chat_n_with_seed", n=3, **SAMPLING),
    chat("chat_best_of", best_of=2, n=2, **SAMPLING),
    chat("chat_tools_none", tools=[TOOL], tool_choice="none"),
    chat("chat_response_format", response_format={"type": "json_object"}, max_completion_tokens=9),
    chat("chat_structured_choice", structured_outputs={"choice": ["left", "right"]}),
    chat("chat_stop", stop=["e"], max_completion_tokens=16),
    chat("chat_logit_bias_seed", logit_bias={"77": 50}, seed=3, temperature=0.5),
    chat("chat_no_generation_prompt", add_generation_prompt=False),
    chat(
        "chat_continue_final_message",
        messages=[*MESSAGES, {"role": "assistant", "content": "the moon is"}],
        add_generation_prompt=False,
        continue_final_message=True,
    ),
    chat("chat_echo", echo=True),
    chat("chat_template_kwargs", chat_template_kwargs={"unused": True}, return_prompt_text=True),
    chat("chat_documents", documents=[{"title": "t", "text": "silver moons"}]),
    chat("chat_prompt_logprobs", prompt_logprobs=1),
    chat("chat_stream", stream=True, stream_options=USAGE),
    chat("chat_stream_n_logprobs", stream=True, n=2, logprobs=True, top_logprobs=2, **SAMPLING),
    # --- refused by vLLM: same status and body
    completion("prompt_too_long", refused=True, prompt=ids(600, 7)),
    completion("max_tokens_too_many", refused=True, max_tokens=600),
    completion("unknown_model", refused=True, model="no-such-model"),
    completion("wrong_type", refused=True, max_tokens="six"),
    completion("n_greedy", refused=True, n=2, temperature=0),
    completion("negative_logprobs", refused=True, logprobs=-3),
    completion("too_many_logprobs", refused=True, logprobs=50),
    completion("min_tokens_over_max", refused=True, min_tokens=9, max_tokens=4),
    completion("bad_stop_token_id", refused=True, stop_token_ids=[10**6]),
    completion("bad_allowed_token_ids", refused=True, allowed_token_ids=[10**6]),
    completion("stream_options_without_stream", refused=True, stream_options=USAGE),
    completion("stream_prompt_logprobs", refused=True, stream=True, prompt_logprobs=1),
    completion("stream_too_long", refused=True, stream=True, prompt=ids(600, 8)),
    completion("suffix", refused=True, suffix="!"),
    completion("empty_prompt", refused=True, prompt=""),
    completion("bad_logit_bias", refused=True, logit_bias={"999999": 5}),
    completion(
        "two_structured_kinds", refused=True, structured_outputs={"choice": ["a"], "regex": "b"}
    ),
    chat("chat_auto_tools", refused=True, tools=[TOOL]),
    chat("chat_no_messages", refused=True, messages=[]),
    chat("chat_unknown_role", messages=[{"role": "nobody", "content": "x"}]),
    chat("chat_top_logprobs_without_logprobs", refused=True, top_logprobs=2),
    chat("chat_logprobs_as_string", logprobs="yes"),  # pydantic reads "yes" as true
    chat("chat_stream_unknown_model", refused=True, stream=True, model="no-such-model"),
    Case("not_json", COMPLETIONS, {}, refused=True, raw=b"{not json"),
    Case("not_an_object", COMPLETIONS, {}, refused=True, raw=b"[1, 2]"),
    # JSON that Python's json reads and msgspec does not: the router's fallback
    # (kvpush/router/jsonbody.py) must forward NaN as NaN, not as null (a default top_p)
    Case(
        "nan_top_p",
        COMPLETIONS,
        {},
        refused=True,
        raw=b'{"model": "@MODEL@", "prompt": "hi", "max_tokens": 4, "top_p": NaN}',
    ),
]

"""A tiny random-weight Llama model with its own tokenizer, made offline and deterministically.

There is no model hub on the test machines, so end-to-end tests and benchmarks build their
model here. The shape is chosen for vLLM's CPU attention backend (head_dim 32 is the
smallest it accepts) and to keep the model about 2 MB. Same seed, same bytes: greedy
output from a single server can then be compared token for token with P/D output.

torch, transformers and tokenizers come with vLLM and are imported inside the functions,
so that `kvpush` itself imports without them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from typing import Any

# Bump when the recipe changes, so that old model directories are rebuilt.
RECIPE_VERSION = 1
STAMP_FILE = "kvpush_tiny_model.json"

VOCAB_SIZE = 1024
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]

MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

# A model of a realistic shape for GPU benchmarks (about 0.8 B parameters, bf16, KV of
# 64 KiB per token), with the same tokenizer; random weights too.
BENCH_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
# For the CPU layer-wise benchmark (scripts/layer_bench.py): enough layers and compute that
# a long prompt's prefill and its KV's trip over a slowed link both take 100s of ms
# (KV of 12 KiB per token, float32).
LAYERS_SHAPE: dict[str, Any] = {
    **MODEL_SHAPE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 12,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
# For the GPU layer-wise benchmark (scripts/layer_bench_gpu.py): the compute per KV byte of
# a large GQA model (Llama-70B: about 2.3 KiB of KV per GFLOP; here 16 KiB per token for
# about 6.6 GFLOP), so that a prefill's compute can hide its KV's trip over a link.
# About 3.3 B parameters (6.6 GB in bf16), 2 KV heads of 128, prompts up to 32k + 64.
GQA_SHAPE: dict[str, Any] = {
    **BENCH_SHAPE,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "max_position_embeddings": 33792,
}
# For the GPU layer-wise benchmark across a link slower than the compute: multi-query
# attention (one KV head of 64, as in Falcon-7B) and a wide MLP, about 4 M FLOP per KV byte
# (Falcon-7B 1.7 M, PaLM-540B 9 M, Llama-70B 0.4 M), so that an 8k prompt's prefill and its
# KV's trip over 1 Gbit/s (256 B per token and layer) take the same order of time.
# About 8.5 B parameters (17 GB in bf16), prompts up to 32k + 64.
MQA_SHAPE: dict[str, Any] = {
    **GQA_SHAPE,
    "hidden_size": 6144,
    "intermediate_size": 24576,
    "num_attention_heads": 96,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
SHAPES = {
    "tiny": MODEL_SHAPE,
    "bench": BENCH_SHAPE,
    "layers": LAYERS_SHAPE,
    "gqa": GQA_SHAPE,
    "mqa": MQA_SHAPE,
}
# Shapes whose weights are made in bf16 from the start: in float32 first, gqa's would need
# 13 GB and twice the time. The others keep their recipe (and their bytes) as they were.
BF16_INIT = {"gqa", "mqa"}

# Role markers as plain text, so any OpenAI chat request renders without special tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SEED_TEXT = """\
The prefill instance reads the whole prompt and writes the key and value cache of every
layer. The decode instance then generates one token at a time, reading that cache again
and again. Moving the cache between the two machines is the price of disaggregation:
push it early, overlap the copy with compute, and never let a block be reused while a
write into it is still in flight. Tests compare the output of one server with the output
of a prefill and decode pair, token for token, with greedy sampling at temperature zero.
"""

_WORDS = (
    "a an the of to in on for with from by at as is are was were be been being it this that "
    "these those model layer token block cache key value prefill decode request transfer "
    "memory write read push pull agent notify lease queue thread worker scheduler router "
    "engine server client stream chunk batch prompt output input time fast slow small large "
    "first last next every each some many few one two three four five six seven eight nine "
    "ten hundred thousand red green blue black white river mountain city house garden tree "
    "water fire stone light dark morning evening night day week year people child world "
    "think know make take give find tell ask work seem feel try leave call keep begin help"
).split()


def training_corpus() -> list[str]:
    """A fixed corpus: prose, numbers, punctuation and seeded pseudo-sentences."""
    rng = random.Random(1234)  # fixed on purpose: the tokenizer must not vary with seed
    lines = _SEED_TEXT.splitlines()
    lines += [" ".join(str(n) for n in range(i, i + 20)) for i in range(0, 2000, 20)]
    lines.append("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t")
    for _ in range(3000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", ";"]))
    return lines


def build_tokenizer(max_length: int = MODEL_SHAPE["max_position_embeddings"]) -> Any:
    """Byte-level BPE trained on `training_corpus()`, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any text encodes, whatever the corpus lacks.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # A leading BOS, as Llama models expect; vLLM adds no BOS of its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def _stamp(seed: int, shape: str = "tiny") -> dict[str, Any]:
    out = {"recipe": RECIPE_VERSION, "seed": seed, "vocab_size": VOCAB_SIZE, **SHAPES[shape]}
    return out if shape == "tiny" else {**out, "shape": shape}


def is_built(out_dir: str, seed: int = 0, shape: str = "tiny") -> bool:
    """True when `out_dir` holds a complete model made by this recipe with this seed."""
    try:
        with open(os.path.join(out_dir, STAMP_FILE)) as f:
            return bool(json.load(f) == _stamp(seed, shape))
    except (OSError, ValueError):
        return False


def make_tiny_model(out_dir: str, seed: int = 0, shape: str = "tiny") -> str:
    """Write the model (``shape``: a key of SHAPES; bench and gqa are for GPUs) and its
    tokenizer into `out_dir` (kept if already built); return it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    out_dir = os.path.abspath(out_dir)
    if is_built(out_dir, seed, shape):
        return out_dir
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(SHAPES[shape]["max_position_embeddings"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        dtype="float32" if shape == "tiny" else "bfloat16",
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    if shape == "tiny":
        model = LlamaForCausalLM(config).float().eval()
    else:  # 0.8 B+ random weights: initialise them on the GPU when there is one
        default = torch.get_default_dtype()
        if shape in BF16_INIT:
            torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
                model = LlamaForCausalLM(config).bfloat16().eval()
        finally:
            torch.set_default_dtype(default)

    os.makedirs(out_dir, exist_ok=True)
    # Build beside the target and move files in, writing the stamp last: an interrupted
    # build never looks complete, so the next call redoes it.
    stale = os.path.join(out_dir, STAMP_FILE)
    if os.path.exists(stale):
        os.remove(stale)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(out_dir)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for name in os.listdir(tmp):
            shutil.move(os.path.join(tmp, name), os.path.join(out_dir, name))
    with open(stale, "w") as f:
        json.dump(_stamp(seed, shape), f, indent=1, sort_keys=True)
    return out_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tiny-model", help="write the tiny random-weight test model to DIR")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    print(make_tiny_model(args.dir, args.seed, args.shape))
    return 0

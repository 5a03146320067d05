"""The tiny test model: shape, tokenizer round trip, determinism, idempotence.

Needs transformers (installed with vLLM by scripts/install_vllm.sh); no skip on purpose.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from kvpush.tiny_model import STAMP_FILE, make_tiny_model


def test_tiny_model_shape_tokenizer_and_determinism(tmp_path: Path) -> None:
    first = make_tiny_model(str(tmp_path / "a"), seed=0)

    config = AutoConfig.from_pretrained(first)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 2
    assert config.hidden_size == 128
    assert config.num_attention_heads == 4
    assert config.num_key_value_heads == 2
    assert config.head_dim == 32
    assert config.max_position_embeddings >= 1024
    assert 900 <= config.vocab_size <= 1100

    tok = AutoTokenizer.from_pretrained(first)
    assert len(tok) == config.vocab_size  # every id the model can emit decodes
    assert (tok.bos_token_id, tok.eos_token_id) == (config.bos_token_id, config.eos_token_id)
    text = "The prefill pushes 1234 blocks; ünïcødé 🙂 and \t tabs."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|user|>\nhi\n<|assistant|>\n"

    # Same seed, same bytes; another seed, other weights but the same tokenizer.
    second = make_tiny_model(str(tmp_path / "b"), seed=0)
    other = make_tiny_model(str(tmp_path / "c"), seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert Path(first, name).read_bytes() == Path(second, name).read_bytes()
    assert (
        Path(first, "model.safetensors").read_bytes()
        != Path(other, "model.safetensors").read_bytes()
    )
    assert Path(first, "tokenizer.json").read_bytes() == Path(other, "tokenizer.json").read_bytes()


def test_existing_model_is_left_alone_unless_seed_differs(tmp_path: Path) -> None:
    out = make_tiny_model(str(tmp_path / "m"))
    weights = Path(out, "model.safetensors")
    os.utime(weights, (1, 1))  # a rebuild would give a new mtime
    assert make_tiny_model(out) == out
    assert weights.stat().st_mtime == 1
    assert json.loads(Path(out, STAMP_FILE).read_text())["seed"] == 0

    make_tiny_model(out, seed=3)
    assert weights.stat().st_mtime != 1
    assert json.loads(Path(out, STAMP_FILE).read_text())["seed"] == 3

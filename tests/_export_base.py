"""A tiny Qwen2 base model folder as released models are: a long context (32,768) the runs never
use whole, RoPE theta 1e6, its own bos/eos ids (two eos), a word-level tokenizer with a chat
template and a ``generation_config.json`` (for tests/models/test_hf_export.py and
tests/actor/test_actor_export.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from _hf_convert import _LLAMA_LIKE, _randomize
from _word_tokenizer import save_word_tokenizer

WORDS = [f"w{i}" for i in range(40)]
VOCAB = 64
BOS, EOS, PAD = 1, [2, 5], 0
MAX_POS, THETA, RUN_LEN = 32768, 1_000_000.0, 64
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"


def save_qwen_base(folder: Path, seed: int = 0):
    """Write the base model folder; returns the transformers model."""
    config = transformers.Qwen2Config(
        **{**_LLAMA_LIKE, "vocab_size": VOCAB, "max_position_embeddings": MAX_POS},
        rope_theta=THETA,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=21,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).eval()
    _randomize(model)
    model.save_pretrained(folder)
    save_word_tokenizer(folder, WORDS, template=TEMPLATE)
    gen = {"bos_token_id": BOS, "eos_token_id": EOS, "temperature": 0.7, "top_p": 0.8, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return model


def tokens(b: int = 2, s: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def check_base_kept(folder: Path) -> transformers.PreTrainedModel:
    """transformers loads ``folder`` with the base model's config fields and files; returns it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    c = model.config
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id) == (BOS, EOS, PAD)
    assert c.max_position_embeddings == MAX_POS
    rope = getattr(c, "rope_parameters", None) or {}
    assert float(rope.get("rope_theta", getattr(c, "rope_theta", 0))) == THETA
    gen = transformers.GenerationConfig.from_pretrained(folder)
    assert gen.eos_token_id == EOS and gen.temperature == 0.7
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == TEMPLATE
    return model

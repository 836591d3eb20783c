"""The arithmetic example in miniature, built here with no download: a tiny random-init Llama
policy whose character-level tokenizer has a chat template, and single-digit sums.

    python examples/arithmetic/make_tiny.py runs/arithmetic_tiny

writes

    <out>/policy/   LlamaForCausalLM (2 layers, width 64, 2 KV heads, context 64, tied embeddings)
                    with its tokenizer: one token per character of the alphabet ('compact':
                    digits and "+-*= "; 'ascii': printable ASCII) and the special tokens below
    <out>/data/     train.jsonl and test.jsonl of compact single-digit sums ({"prompt": "3+4=",
                    "answer": "7"}): the 25 sums of 0-4, each 8 times in train.jsonl, once in
                    test.jsonl

The chat template is short so that a prompt stays a few tokens long (7 for "3+4="):

    <|user|>3+4=<|end|><|assistant|>         (a system message first: <|system|>...<|end|>)

and the policy answers "7<|end|>": ``<|end|>`` is the end-of-sequence token.

A random-init policy has to learn every sum from the reward alone, so the table is small (25
sums) and each sum comes up several times a step (the copies in train.jsonl: a batch of 200
holds each about 8 times). The test split holds the same sums: validation measures what was
learnt, not generalisation to unseen sums. With the settings of examples/arithmetic/README.md the
reward rises from about 0.1 to over 0.5 in 60 steps.

The architecture is Llama's rather than Qwen2's because transformers 5 loads the tokenizer of a
``qwen2`` folder as its own byte-level ``Qwen2Tokenizer`` whatever the folder's
``tokenizer_class`` says, which would not keep a character-level vocabulary; a ``llama`` folder
keeps the tokenizer it was saved with.
"""

from __future__ import annotations

import argparse
import os
import string
import sys
from typing import Any

SPECIALS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>")
EOS = "<|end|>"
ALPHABETS = {
    "compact": string.digits + "+-*= ",
    "ascii": "".join(chr(c) for c in range(32, 127)),
}
"""The characters each ``--alphabet`` choice gives a token."""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""Jinja: each message as <|role|>content<|end|>, then <|assistant|> to start the reply."""
CONTEXT = 64


def chat_tokenizer(alphabet: str = "compact"):
    """A character-level tokenizer (a BPE model with one token per character and no merges, built
    with the ``tokenizers`` library) with :data:`CHAT_TEMPLATE`, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if alphabet not in ALPHABETS:
        raise ValueError(f"alphabet={alphabet!r}: expected one of {list(ALPHABETS)}")
    chars = ALPHABETS[alphabet]
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({c: len(SPECIALS) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # characters back to back, no spaces between tokens
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token=EOS,
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=CONTEXT,
    )


def build_policy(out: str, alphabet: str = "compact", seed: int = 0) -> str:
    """A random-init tiny Llama policy with :func:`chat_tokenizer` in ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = chat_tokenizer(alphabet)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build(out: str, alphabet: str = "compact", seed: int = 0, copies: int = 8) -> dict[str, str]:
    """``<out>/policy`` and ``<out>/data``: the 25 sums of operands 0-4 in compact style, each
    ``copies`` times in train.jsonl (shuffled) and once in test.jsonl."""
    import random

    make_data = _sibling("make_data")
    policy = build_policy(os.path.join(out, "policy"), alphabet, seed)
    problems = make_data.make_problems(25, max_operand=4, ops="+", style="compact", seed=seed)
    train = problems * copies
    random.Random(seed).shuffle(train)
    data = os.path.join(out, "data")
    make_data.write_splits(data, {"train": train, "test": problems})
    return {"policy": policy, "data": data}


def _sibling(name: str) -> Any:
    """The module ``<name>.py`` beside this file (loaded under a name of its own, so that another
    example's module of the same name is never taken for it)."""
    import importlib.util

    key = f"_arithmetic_example_{name}"
    if key not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write policy/ and data/ into")
    ap.add_argument("--alphabet", default="compact", choices=sorted(ALPHABETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--copies", type=int, default=8, help="times each sum appears in train.jsonl")
    a = ap.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for name, path in build(a.out, a.alphabet, a.seed, a.copies).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()

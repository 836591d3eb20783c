"""Tiny HF models for the one-process conversion tests (tests/models/test_hf_convert*.py, but
not the TP/PP ones): the families and configs they cover, and how they are built, saved and run."""

from __future__ import annotations

import torch
import transformers

from aligner.models import forward

VOCAB = 100
TOL = 1e-4


def _randomize(model: torch.nn.Module) -> None:
    """Norm weights and biases away from 1/0, so a misplaced one changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.copy_(
                    1.0 + 0.3 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p)
                )
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))


_LLAMA_LIKE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=32,
    rms_norm_eps=1e-5,
)
_GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32)
# Llama 3.1's RoPE scaling on a tiny model: with heads 16 wide and theta 1e4 the wavelengths
# are 6.3, 19.9, 62.8, ...; an original context of 32 keeps the first (< 32/4), smooths the
# second and divides the rest by the factor (at width 32: keeps 1, smooths 2); sequences of 48
# run past 32.
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
# Heads 32 wide, not hidden_size / heads = 16.
_WIDE_HEADS = dict(_LLAMA_LIKE, head_dim=32, max_position_embeddings=64)

CASES = {
    # name: (config class, model class, config kwargs)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_LIKE, tie_word_embeddings=False)),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_LIKE, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA_LIKE, tie_word_embeddings=True)),
    "qwen2_untied": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(_LLAMA_LIKE, tie_word_embeddings=False, rope_theta=1000000.0),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(_LLAMA_LIKE, num_key_value_heads=1, sliding_window=None, rope_theta=500000.0),
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2)),
    "gpt2_untied": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, tie_word_embeddings=False, n_inner=96)),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(_LLAMA_LIKE, max_position_embeddings=64, rope_parameters=_LLAMA3_ROPE),
    ),
    "llama_head_dim": ("LlamaConfig", "LlamaForCausalLM", dict(_WIDE_HEADS)),
    # Qwen2.5 as released: tied embeddings on small sizes, a sliding window that is present but
    # unused (shorter than the context, so a wrong cap would show), max_window_layers.
    "qwen2_5": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            _LLAMA_LIKE,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=16,
            max_window_layers=1,
            rope_theta=1000000.0,
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_WIDE_HEADS, tie_word_embeddings=True)),
    "qwen3_llama3_rope": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_WIDE_HEADS, tie_word_embeddings=False, rope_parameters=_LLAMA3_ROPE),
    ),
}
# Sequence lengths: past the llama3 scaling's original context where the model allows it.
SEQ = {"llama3_rope": 48, "llama_head_dim": 48, "qwen3": 48, "qwen3_llama3_rope": 48}


def _hf_model(case: str, seed: int = 0, model_class: str | None = None, **extra):
    config_cls, model_cls, kw = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**kw, **extra}, attn_implementation="eager")
    model = getattr(transformers, model_class or model_cls)(config).eval()
    _randomize(model)
    return model


def _save(model, path) -> str:
    model.save_pretrained(path)
    return str(path)


def _tokens(b=2, s=12, seed=1):
    return torch.randint(1, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def _our_logits(model, tokens):
    model.eval()
    with torch.no_grad():
        return forward.policy_logits(model, tokens)

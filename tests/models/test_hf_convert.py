"""HF <-> Megatron conversion in one process (TP=1): parity with transformers and round trips
for every family (RoPE scaling, head widths and q/k norms among them), reward models and critics
from HF heads, and the mapping of HF configs to ours."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
import transformers
from _hf_convert import (
    _GPT2,
    _LLAMA3_ROPE,
    _LLAMA_LIKE,
    CASES,
    SEQ,
    TOL,
    VOCAB,
    _hf_model,
    _logits,
    _our_logits,
    _save,
    _tokens,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from aligner.models import forward, gpt, hf, hf_config, hf_names, rope
from aligner.models.config import ConversionError

pytestmark = pytest.mark.usefixtures("one_process_world")


# --------------------------------------------------------------------------------------------
# Parity and round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_matches_transformers_and_export_round_trips(case, tmp_path):
    ref = _hf_model(case)
    src = _save(ref, tmp_path / "src")
    tokens = _tokens(s=SEQ.get(case, 12))
    expected = _logits(ref, tokens)

    model, cfg = hf.import_hf(src, make_vocab_size_divisible_by=16)
    assert cfg.padded_vocab_size() == 112  # the Megatron embedding has padded rows
    for mode in ("megatron", "fused"):  # Megatron's own forward and ours over its parameters
        assert forward.set_forward(model, mode) == (mode, None)
        ours = _our_logits(model, tokens)
        assert ours.shape[-1] == 112
        assert (ours[..., :VOCAB] - expected).abs().max().item() < TOL, mode

    out = hf.export_hf(model, cfg, tmp_path / "out", CASES[case][1], hf_config=src)
    # The padded vocabulary is trimmed, and the files hold exactly what transformers saved.
    original = load_file(os.path.join(src, "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    reloaded = getattr(transformers, CASES[case][1]).from_pretrained(out, attn_implementation="eager").eval()
    assert (_logits(reloaded, tokens) - expected).abs().max().item() < TOL
    # The exported config describes the same model (head width, q/k norms, RoPE, no window).
    assert hf_config.model_config_from_hf(out, make_vocab_size_divisible_by=16) == cfg


def test_new_families_import_what_they_are(tmp_path):
    """What each family's config sets: the head width only when it is one of its own, q/k norms
    for Qwen3, the llama3 scaling's four parameters, and no sliding-window cap for Qwen2.5."""
    got = {case: hf_config.model_config_from_hf(_hf_model(case).config) for case in CASES}
    assert got["llama_head_dim"].kv_channels == 32 and got["llama_head_dim"].head_dim == 32
    assert got["llama"].kv_channels is None and got["llama"].head_dim == 16
    assert got["qwen3"].qk_layernorm and got["qwen3"].head_dim == 32 and got["qwen3"].tie_embeddings
    assert not any(got[c].qk_layernorm for c in ("llama", "qwen2", "qwen2_5", "llama_head_dim"))
    q = got["qwen2_5"]
    assert q.max_seq_len == 32 and q.tie_embeddings and q.add_qkv_bias and q.rotary_base == 1e6
    r = got["llama3_rope"]
    assert (r.rope_scaling, r.rope_scaling_factor, r.rope_low_freq_factor, r.rope_high_freq_factor) == (
        "llama3",
        8.0,
        1.0,
        4.0,
    )
    assert r.rope_original_max_position == 32 and r.max_seq_len == 64
    assert got["llama"].rope_scaling is None
    # An older config says rope_scaling (and 'type'): the same model config.
    old = {**_LLAMA_LIKE, "max_position_embeddings": 64, "architectures": ["LlamaForCausalLM"]}
    old["rope_scaling"] = {k: v for k, v in _LLAMA3_ROPE.items() if k not in ("rope_type", "rope_theta")}
    old["rope_scaling"]["type"] = "llama3"
    assert hf_config.model_config_from_hf(old) == r
    # Without original_max_position_embeddings, transformers takes max_position_embeddings.
    short = {**old, "rope_scaling": {**old["rope_scaling"]}}
    del short["rope_scaling"]["original_max_position_embeddings"]
    assert hf_config.model_config_from_hf(short).rope_original_max_position == 64


def _naive_llama3(d, base, factor, low, high, original):
    """transformers' llama3 formula written out one frequency at a time, in Python floats."""
    out = []
    for i in range(0, d, 2):
        f = 1.0 / base ** (i / d)
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def test_llama3_frequencies_against_the_formula():
    cfg = hf_config.model_config_from_hf(_hf_model("llama3_rope").config)
    mine = rope.inverse_frequencies(cfg)
    naive = _naive_llama3(16, 1e4, 8.0, 1.0, 4.0, 32)
    plain = _naive_llama3(16, 1e4, 1.0, 1.0, 4.0, 32)  # factor 1: nothing scaled
    torch.testing.assert_close(mine, torch.tensor(naive, dtype=torch.float32), rtol=1e-6, atol=0)
    # All three regimes occur: kept, smoothed, divided by the factor.
    ratios = [a / b for a, b in zip(naive, plain)]
    assert ratios[0] == 1.0 and 1 / 8 < ratios[1] < 1 and ratios[2:] == [1 / 8] * 6
    # At width 32 (Qwen3 case): one kept, two smoothed.
    wide = rope.inverse_frequencies(hf_config.model_config_from_hf(_hf_model("qwen3_llama3_rope").config))
    torch.testing.assert_close(
        wide, torch.tensor(_naive_llama3(32, 1e4, 8.0, 1.0, 4.0, 32)), rtol=1e-6, atol=0
    )
    # Bit for bit what transformers computes, and what the built model's rotary embedding holds.
    hf_freq, scale = ROPE_INIT_FUNCTIONS["llama3"](_hf_model("llama3_rope").config, "cpu")
    assert torch.equal(mine, hf_freq) and scale == 1.0
    model = gpt.build_policy(cfg)
    assert torch.equal(model.rotary_pos_emb.inv_freq, mine)
    plain_model = gpt.build_policy(hf_config.model_config_from_hf(_hf_model("llama").config))
    assert torch.equal(
        plain_model.rotary_pos_emb.inv_freq, rope.inverse_frequencies(plain_model.aligner_config)
    )


def test_llama3_scaling_changes_the_logits(tmp_path):
    """The parity above is not vacuous: the same weights with plain RoPE give logits further
    from transformers' than its tolerance."""
    ref = _hf_model("llama3_rope")
    model, cfg = hf.import_hf(_save(ref, tmp_path / "src"))
    plain = gpt.build_policy(dataclasses.replace(cfg, rope_scaling=None))
    gpt.load_state_dict_strict(plain, gpt.tensor_state_dict(model))
    tokens = _tokens(s=48)
    diff = (_our_logits(plain, tokens) - _logits(ref, tokens)).abs().max().item()
    assert diff > 10 * TOL, diff


def test_padded_vocab_rows_are_zero(llama_dir):
    _, src = llama_dir
    model, cfg = hf.import_hf(src, make_vocab_size_divisible_by=64)
    state = gpt.tensor_state_dict(model)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert state[name].shape[0] == 128
        assert torch.count_nonzero(state[name][VOCAB:]) == 0
        assert torch.count_nonzero(state[name][:VOCAB]) > 0


def test_shorter_max_seq_len_for_rope_models(llama_dir):
    ref, src = llama_dir
    model, cfg = hf.import_hf(src, max_seq_len=16)
    assert cfg.max_seq_len == 16
    tokens = _tokens(s=16)
    assert (_our_logits(model, tokens) - _logits(ref, tokens)).abs().max().item() < TOL
    with pytest.raises(ConversionError, match="n_positions"):
        hf_config.model_config_from_hf(transformers.GPT2Config(**_GPT2), max_seq_len=16)


def test_stream_names_match_hf_state_dict_and_specs(llama_dir):
    ref, src = llama_dir
    model, cfg = hf.import_hf(src)
    streamed = dict(hf.iter_hf_tensors(model, cfg, "LlamaForCausalLM"))
    assert list(streamed) == [n for n, _ in hf_names.hf_tensor_specs(cfg, "LlamaForCausalLM")]
    ref_state = ref.state_dict()
    assert set(streamed) == set(ref_state)
    for name, t in streamed.items():
        assert torch.equal(t, ref_state[name]), name


def test_export_in_bfloat16(llama_dir, tmp_path):
    ref, src = llama_dir
    model, cfg = hf.import_hf(src)
    out = hf.export_hf(model, cfg, tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens()
    assert (_logits(reloaded, tokens) - _logits(ref, tokens)).abs().max().item() < 0.1


def test_import_from_sharded_index(llama_dir, tmp_path):
    """An index (model.safetensors.index.json) with the tensors split over two files."""
    ref, src = llama_dir
    state = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(os.path.join(src, "config.json"), folder / "config.json")
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, keys in files.items():
        save_file({k: state[k] for k in keys}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = hf.import_hf(folder)
    tokens = _tokens()
    assert (_our_logits(model, tokens) - _logits(ref, tokens)).abs().max().item() < TOL


def test_load_from_in_memory_state_dict(llama_dir):
    ref, src = llama_dir
    cfg = hf_config.model_config_from_hf(ref.config)
    model = gpt.build_policy(cfg)
    hf.load_hf_into_megatron(model, ref.state_dict(), cfg, "LlamaForCausalLM")
    tokens = _tokens()
    assert (_our_logits(model, tokens) - _logits(ref, tokens)).abs().max().item() < TOL


def test_gpt2_checkpoint_without_transformer_prefix(tmp_path):
    """Older GPT-2 checkpoints name their tensors ``h.0...``/``wte.weight``."""
    ref = _hf_model("gpt2")
    src = _save(ref, tmp_path / "gpt2")
    path = os.path.join(src, "model.safetensors")
    state = load_file(path)
    save_file({k.removeprefix("transformer."): v for k, v in state.items()}, path, metadata={"format": "pt"})
    model, _ = hf.import_hf(src)
    tokens = _tokens()
    assert (_our_logits(model, tokens)[..., :VOCAB] - _logits(ref, tokens)).abs().max().item() < TOL


def test_export_copies_tokenizer_files(llama_dir, tmp_path):
    _, src = llama_dir
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    (tok / "unrelated.txt").write_text("x")
    model, cfg = hf.import_hf(src)
    out = hf.export_hf(model, cfg, tmp_path / "out", "LlamaForCausalLM", tokenizer_dir=tok)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    with pytest.raises(ConversionError, match="tokenizer folder .*nowhere does not exist"):
        hf.export_hf(model, cfg, tmp_path / "out2", "llama", tokenizer_dir=tmp_path / "nowhere")


# --------------------------------------------------------------------------------------------
# Reward models and critics
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case,cls",
    [
        ("llama", "LlamaForSequenceClassification"),
        ("qwen2", "Qwen2ForSequenceClassification"),
        ("llama3_rope", "LlamaForSequenceClassification"),
        ("qwen3", "Qwen3ForSequenceClassification"),
    ],
)
def test_reward_model_from_sequence_classifier(case, cls, tmp_path):
    ref = _hf_model(case, model_class=cls, num_labels=1, pad_token_id=0)
    src = _save(ref, tmp_path / "rm")
    # Right-padded samples of different lengths: HF reads the last non-pad token.
    n = SEQ.get(case, 10)
    tokens = _tokens(b=3, s=n)
    lengths = torch.tensor([n, n - 3, 4])
    for i, n in enumerate(lengths.tolist()):
        tokens[i, n:] = 0
    with torch.no_grad():
        expected = ref(tokens).logits[:, 0]

    model, cfg = hf.import_hf(src, "reward")
    state = gpt.tensor_state_dict(model)
    assert torch.equal(state["output_layer.weight"], ref.score.weight.detach())
    assert torch.count_nonzero(state["output_layer.bias"]) == 0
    model.eval()
    for mode in ("megatron", "fused"):
        forward.set_forward(model, mode)
        with torch.no_grad():
            scores = forward.sequence_scores(model, tokens, lengths)
        assert (scores - expected).abs().max().item() < TOL, mode

    out = hf.export_hf(model, cfg, tmp_path / "out", cls, hf_config=src)
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]
    reloaded = getattr(transformers, cls).from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        assert (reloaded(tokens).logits[:, 0] - expected).abs().max().item() < TOL

    # A trained (non-zero) bias has no place in HF's score layer: refuse rather than drop it.
    with torch.no_grad():
        model.output_layer.bias.fill_(0.5)
    with pytest.raises(ConversionError, match=r"output_layer\.bias"):
        hf.export_hf(model, cfg, tmp_path / "biased", cls)
    assert not (tmp_path / "biased").exists()


def test_critic_from_causal_lm_keeps_fresh_head(llama_dir):
    _, src = llama_dir
    policy, _ = hf.import_hf(src, "policy")
    critic, _ = hf.import_hf(src, "critic")
    p, c = gpt.tensor_state_dict(policy), gpt.tensor_state_dict(critic)
    trunk = [k for k in c if not k.startswith("output_layer.")]
    assert trunk and all(torch.equal(p[k], c[k]) for k in trunk)
    assert c["output_layer.weight"].shape == (1, 64) and torch.count_nonzero(c["output_layer.weight"]) > 0
    assert torch.count_nonzero(c["output_layer.bias"]) == 0


# --------------------------------------------------------------------------------------------
# Config mapping
# --------------------------------------------------------------------------------------------


def test_model_config_from_hf_fields():
    c = hf_config.model_config_from_hf(transformers.GPT2Config(**_GPT2))
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.ffn_size, c.max_seq_len) == (
        2,
        64,
        4,
        256,
        32,
    )
    assert (c.activation, c.normalization, c.position_embedding) == (
        "gelu_tanh",
        "LayerNorm",
        "learned_absolute",
    )
    assert c.tie_embeddings and c.add_bias_linear
    q = hf_config.model_config_from_hf(transformers.Qwen2Config(**_LLAMA_LIKE, rope_theta=1e6))
    assert q.add_qkv_bias and not q.add_bias_linear and q.rotary_base == 1e6 and q.kv_heads == 2
    assert q.norm_epsilon == 1e-5 and q.ffn_size == 96 and q.activation == "swiglu"
    m = hf_config.model_config_from_hf(
        transformers.MistralConfig(**{**_LLAMA_LIKE, "max_position_embeddings": 4096}, sliding_window=1024)
    )
    assert m.max_seq_len == 1024  # capped at the sliding window
    lb = hf_config.model_config_from_hf(
        transformers.LlamaConfig(**_LLAMA_LIKE, attention_bias=True, mlp_bias=True)
    )
    assert lb.add_bias_linear

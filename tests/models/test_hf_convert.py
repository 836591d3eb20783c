"""HF <-> Megatron conversion in one process (TP=1): parity with transformers, round trips,
reward models, our checkpoint format, the CLI, and the errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from aligner import distributed
from aligner.models import (
    checkpoint_io,
    convert_cli,
    forward,
    gpt,
    hf,
    hf_config,
    hf_names,
    model_files,
    rope,
)
from aligner.models.config import ConversionError, ModelConfig

VOCAB = 100
TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _world():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    transformers.logging.set_verbosity_error()
    distributed.initialize(distributed.ParallelConfig())
    yield
    distributed.destroy()


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


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = _hf_model("llama")
    return model, _save(model, tmp_path_factory.mktemp("hf") / "llama")


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


# --------------------------------------------------------------------------------------------
# Our checkpoint format
# --------------------------------------------------------------------------------------------


def test_checkpoint_round_trip_across_vocab_padding(llama_dir, tmp_path):
    ref, src = llama_dir
    model, cfg = hf.import_hf(src, make_vocab_size_divisible_by=16)
    ckpt = checkpoint_io.save_model_checkpoint(
        model, cfg, tmp_path / "ckpt", hf_architecture="LlamaForCausalLM"
    )
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["format"] == "aligner-model" and meta["version"] == 1 and meta["role"] == "policy"
    assert ModelConfig.from_dict(meta["model_config"]) == cfg
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert f.get_slice("embedding.word_embeddings.weight").get_shape() == [VOCAB, 64]
        assert "decoder.layers.1.mlp.linear_fc1.weight" in f.keys()

    other = gpt.build_policy(ModelConfig.from_dict({**cfg.to_dict(), "make_vocab_size_divisible_by": 1}))
    checkpoint_io.load_model_checkpoint(other, ckpt)
    tokens = _tokens()
    assert (_our_logits(other, tokens) - _logits(ref, tokens)).abs().max().item() < TOL

    # Overwriting needs consent; the folder is replaced as a whole.
    with pytest.raises(ConversionError, match="not empty"):
        checkpoint_io.save_model_checkpoint(model, cfg, ckpt)
    checkpoint_io.save_model_checkpoint(model, cfg, ckpt, overwrite=True)
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_reward_checkpoint_loads_into_critic(tmp_path):
    ref = _hf_model("llama", model_class="LlamaForSequenceClassification", num_labels=1, pad_token_id=0)
    src = _save(ref, tmp_path / "rm")
    rm, cfg = hf.import_hf(src, "reward")
    ckpt = checkpoint_io.save_model_checkpoint(rm, cfg, tmp_path / "ckpt")
    critic = gpt.build_critic(cfg)
    assert checkpoint_io.load_model_checkpoint(critic, ckpt)["role"] == "reward"
    assert torch.equal(gpt.tensor_state_dict(critic)["output_layer.weight"], ref.score.weight.detach())
    with pytest.raises(ConversionError, match="meta.json"):
        checkpoint_io.load_model_checkpoint(gpt.build_policy(cfg), ckpt)


def test_checkpoint_errors_name_the_file(llama_dir, tmp_path):
    _, src = llama_dir
    model, cfg = hf.import_hf(src)
    with pytest.raises(ConversionError, match="does not exist"):
        checkpoint_io.load_model_checkpoint(model, tmp_path / "nowhere")
    ckpt = checkpoint_io.save_model_checkpoint(model, cfg, tmp_path / "ckpt")
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "format": "something-else"}))
    with pytest.raises(ConversionError, match=r"meta\.json.*format"):
        checkpoint_io.load_model_checkpoint(model, ckpt)
    (ckpt / "meta.json").write_text("{not json")
    with pytest.raises(ConversionError, match=r"meta\.json.*not valid JSON"):
        checkpoint_io.load_model_checkpoint(model, ckpt)
    (ckpt / "meta.json").write_text(
        json.dumps({**meta, "model_config": {**meta["model_config"], "num_layers": 3}})
    )
    with pytest.raises(ConversionError, match=r"num_layers: 2 != 3"):
        checkpoint_io.load_model_checkpoint(model, ckpt)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    state = load_file(str(ckpt / "model.safetensors"))
    state["decoder.final_layernorm.weight"] = torch.ones(63)
    save_file(state, str(ckpt / "model.safetensors"))
    with pytest.raises(
        ConversionError, match=r"decoder\.final_layernorm\.weight: expected shape \(64,\), got \(63,\)"
    ):
        checkpoint_io.load_model_checkpoint(model, ckpt)


def test_model_files_write_streams_and_refuse_bad_input(tmp_path):
    entries = [("a", (2, 3), torch.float32), ("b", (4,), torch.bfloat16)]
    tensors = {"a": torch.randn(2, 3), "b": torch.randn(4).bfloat16()}
    model_files.write_tensor_stream(iter(tensors.items()), tmp_path / "t.safetensors", entries)
    back = load_file(str(tmp_path / "t.safetensors"))
    assert list(back) == ["a", "b"] and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ConversionError, match=r"expected tensor a \(2, 3\) torch.float32 next, got b"):
        model_files.write_tensor_stream(iter([("b", tensors["b"])]), tmp_path / "u.safetensors", entries)
    with pytest.raises(ConversionError, match="1 tensors were never written"):
        model_files.write_tensor_stream(iter([("a", tensors["a"])]), tmp_path / "v.safetensors", entries)

    assert model_files.as_dtype("bf16") is torch.bfloat16
    assert model_files.as_dtype(torch.float16) is torch.float16 and model_files.as_dtype(None) is None
    with pytest.raises(ConversionError, match="dtype='int4': expected one of"):
        model_files.as_dtype("int4")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConversionError, match=r"thing: .*list\.json holds a list, expected a JSON object"):
        model_files.read_json_object(tmp_path / "list.json", "thing")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    with pytest.raises(ConversionError, match="is not empty"):
        model_files.check_output_dir(full, overwrite=False)
    model_files.check_output_dir(full, overwrite=True)
    with pytest.raises(ConversionError, match="exists and is not a folder"):
        model_files.check_output_dir(full / "x", overwrite=True)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _copy_hf(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_missing_folder(tmp_path):
    with pytest.raises(ConversionError, match=r"nowhere does not exist"):
        hf.import_hf(tmp_path / "nowhere")


def test_folder_without_config(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ConversionError, match=r"config\.json does not exist"):
        hf.import_hf(d)


def test_malformed_config(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    with open(os.path.join(d, "config.json"), "w") as fh:
        fh.write('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ConversionError, match=r"config\.json is not valid JSON"):
        hf.import_hf(d)


def test_config_field_with_wrong_type(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    conf = json.loads(open(os.path.join(d, "config.json")).read())
    conf["num_hidden_layers"] = "two"
    open(os.path.join(d, "config.json"), "w").write(json.dumps(conf))
    with pytest.raises(ConversionError, match=r"config\.json.*num_hidden_layers"):
        hf.import_hf(d)


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    conf = json.loads(open(os.path.join(d, "config.json")).read())
    conf["architectures"] = ["FalconForCausalLM"]
    open(os.path.join(d, "config.json"), "w").write(json.dumps(conf))
    with pytest.raises(ConversionError, match=r"'FalconForCausalLM' is not supported.*LlamaForCausalLM"):
        hf.import_hf(d)


_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
            r"rope_parameters\.rope_type='linear' \(rope scaling\) is not supported; "
            r"supported: 'default', 'llama3'",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": 8,
                }
            },
            r"rope_type='yarn' .*supported: 'default', 'llama3'",
        ),
        (  # an older config's rope_scaling with 'type'
            {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            r"rope_type='dynamic' .*supported: 'default', 'llama3'",
        ),
        (
            {"rope_parameters": {**_PLAIN_ROPE, "partial_rotary_factor": 0.5}},
            r"partial_rotary_factor=0\.5 is not supported \(rotary on the full head only\)",
        ),
        (
            {"rope_parameters": {"full_attention": _PLAIN_ROPE, "sliding_attention": _PLAIN_ROPE}},
            r"rope_parameters per layer type \['full_attention', 'sliding_attention'\] are not supported",
        ),
    ],
    ids=["linear", "yarn", "dynamic_rope_scaling", "partial_rotary", "per_layer_type"],
)
def test_unsupported_rope_is_refused(llama_dir, tmp_path, change, message):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    conf = json.loads(open(os.path.join(d, "config.json")).read())
    conf.update(change)
    open(os.path.join(d, "config.json"), "w").write(json.dumps(conf))
    with pytest.raises(
        ConversionError, match=r"(?s)config\.json \(LlamaForCausalLM\) cannot be converted.*" + message
    ):
        hf.import_hf(d)


def test_unsupported_family_settings_are_refused():
    """Qwen3 with attention biases, a mixture-of-experts Qwen3, and a sliding window that is
    used (Qwen2/Qwen3 with use_sliding_window on some layers) past max_seq_len."""
    qwen3 = {**_WIDE_HEADS, "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(
        ConversionError, match=r"attention_bias=True is not supported for Qwen3.*supported: false"
    ):
        hf_config.model_config_from_hf({**qwen3, "attention_bias": True})
    with pytest.raises(
        ConversionError, match=r"'Qwen3MoeForCausalLM' is not supported \(mixture-of-experts models are not"
    ):
        hf_config.model_config_from_hf({**qwen3, "architectures": ["Qwen3MoeForCausalLM"]})
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        windowed = {
            **qwen3,
            "architectures": [arch],
            "use_sliding_window": True,
            "sliding_window": 16,
            "max_window_layers": 1,
        }
        assert hf_config.model_config_from_hf(windowed).max_seq_len == 16  # within it: full attention
        with pytest.raises(ConversionError, match=r"max_seq_len=64 is longer than sliding_window=16"):
            hf_config.model_config_from_hf(windowed, max_seq_len=64)
        # Every layer below max_window_layers: the window is never used, nothing is capped.
        assert hf_config.model_config_from_hf({**windowed, "max_window_layers": 2}).max_seq_len == 64


def test_export_refuses_what_the_family_cannot_hold():
    qwen3 = hf_config.model_config_from_hf(_hf_model("qwen3").config)
    llama = hf_config.model_config_from_hf(_hf_model("llama").config)
    assert hf_config.export_problems(qwen3, "qwen3") == []
    for family in ("llama", "qwen2", "mistral"):
        assert any(
            p.startswith("qk_layernorm=True: ") and "export as Qwen3ForCausalLM" in p
            for p in hf_config.export_problems(qwen3, family)
        ), family
    assert hf_config.export_problems(llama, "qwen3") == ["qk_layernorm=False: Qwen3 always has q/k norms"]
    # With no architecture named (a model trained from scratch), the family that fits.
    defaults = {
        case: hf_config.default_architecture(hf_config.model_config_from_hf(_hf_model(case).config))
        for case in ("qwen3", "qwen2", "llama", "llama3_rope", "gpt2")
    }
    assert defaults == {
        "qwen3": "Qwen3ForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "llama": "LlamaForCausalLM",
        "llama3_rope": "LlamaForCausalLM",
        "gpt2": "GPT2LMHeadModel",
    }
    with pytest.raises(ConversionError, match=r"cannot export this model as Qwen3ForCausalLM"):
        hf_config.hf_config_from_model_config(llama, "qwen3")
    wide = dataclasses.replace(
        hf_config.model_config_from_hf(transformers.GPT2Config(**_GPT2)), kv_channels=32
    )
    assert "kv_channels=32: GPT-2's heads are hidden_size/n_head wide" in hf_config.export_problems(
        wide, "gpt2"
    )


def test_tensor_with_wrong_shape(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    path = os.path.join(d, "model.safetensors")
    state = load_file(path)
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(
        ConversionError,
        match=r"model\.layers\.1\.self_attn\.k_proj\.weight in .*model\.safetensors: "
        r"expected shape \(32, 64\), got \(16, 64\)",
    ):
        hf.import_hf(d)


def test_missing_tensor(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    path = os.path.join(d, "model.safetensors")
    state = load_file(path)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"missing tensor model\.layers\.0\.mlp\.up_proj\.weight"):
        hf.import_hf(d)


def test_missing_safetensors(llama_dir, tmp_path):
    d = _copy_hf(llama_dir[1], tmp_path / "x")
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ConversionError, match=r"no model\.safetensors"):
        hf.import_hf(d)


def test_tp_size_that_does_not_divide_heads(llama_dir):
    with pytest.raises(
        ConversionError, match=r"num_attention_heads=4 is not divisible by tensor_model_parallel_size=3"
    ):
        hf.validate_hf_folder(llama_dir[1], tensor_parallel_size=3)


def test_policy_from_sequence_classifier_is_refused(tmp_path):
    src = _save(
        _hf_model("llama", model_class="LlamaForSequenceClassification", num_labels=1, pad_token_id=0),
        tmp_path / "rm",
    )
    with pytest.raises(ConversionError, match="not as a policy"):
        hf.import_hf(src, "policy")


def test_export_to_a_family_that_cannot_hold_the_model(tmp_path):
    src = _save(_hf_model("gpt2"), tmp_path / "gpt2")
    model, cfg = hf.import_hf(src)
    with pytest.raises(
        ConversionError, match=r"(?s)cannot export this model as LlamaForCausalLM.*normalization"
    ):
        hf.export_hf(model, cfg, tmp_path / "out", "llama")
    assert not (tmp_path / "out").exists()


def test_config_mismatch_is_reported(llama_dir):
    _, src = llama_dir
    cfg = hf_config.model_config_from_hf(src)
    other = ModelConfig.from_dict({**cfg.to_dict(), "ffn_hidden_size": 128})
    with pytest.raises(ConversionError, match=r"ffn_hidden_size: 128 != 96"):
        hf.load_hf_into_megatron(gpt.build_policy(other), src, other)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def test_cli_import_export_round_trip(llama_dir, tmp_path, capsys):
    ref, src = llama_dir
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert convert_cli.main(["import", src, str(ckpt), "--make-vocab-size-divisible-by", "8"]) == 0
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["hf_architecture"] == "LlamaForCausalLM" and meta["role"] == "policy"
    assert meta["model_config"]["make_vocab_size_divisible_by"] == 8
    assert convert_cli.main(["export", str(ckpt), str(out)]) == 0
    original = load_file(os.path.join(src, "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = _tokens()
    assert (_logits(reloaded, tokens) - _logits(ref, tokens)).abs().max().item() < TOL
    # The CLI left the test's parallel state as it found it.
    from megatron.core import parallel_state as mpu

    assert mpu.model_parallel_is_initialized()


def test_cli_reports_errors(llama_dir, tmp_path, capsys):
    assert convert_cli.main(["import", llama_dir[1], str(tmp_path / "c"), "--tp", "3"]) == 1
    err = capsys.readouterr().err
    assert "num_attention_heads=4 is not divisible by tensor_model_parallel_size=3" in err
    assert convert_cli.main(["export", str(tmp_path / "missing"), str(tmp_path / "o")]) == 1
    assert "missing does not exist" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()

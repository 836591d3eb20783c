"""Model config validation and the three Megatron GPT variants (single process, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from aligner import distributed
from aligner.config_checks import ConfigError
from aligner.models import forward, gpt
from aligner.models.config import ModelConfig

TINY = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=16, max_seq_len=16)


@pytest.fixture(scope="module", autouse=True)
def world():
    distributed.initialize(distributed.ParallelConfig(), seed=11)
    yield
    distributed.destroy()


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (
            dict(hidden_size=30, num_attention_heads=4),
            "hidden_size=30 is not divisible by num_attention_heads=4",
        ),
        (
            dict(num_attention_heads=4, num_query_groups=3),
            "num_attention_heads=4 is not divisible by num_query_groups=3",
        ),
        (dict(num_layers=0), "num_layers=0"),
        (dict(normalization="BatchNorm"), "normalization='BatchNorm'"),
        (dict(activation="tanh"), "activation='tanh'"),
        (dict(position_embedding="alibi"), "position_embedding='alibi'"),
        (dict(hidden_dropout=1.5), "hidden_dropout=1.5"),
        (dict(vocab_size=-3), "vocab_size=-3"),
        (dict(kv_channels=0), "kv_channels=0: expected a positive integer"),
        (dict(kv_channels=7), "head dim 7 (kv_channels) must be even for rope"),
        (dict(qk_layernorm="yes"), "qk_layernorm='yes': expected true or false"),
        (dict(recompute="True"), "recompute='True': expected one of ('none', 'full')"),
        (dict(rope_scaling="yarn"), "rope_scaling='yarn': expected null or one of ('llama3',)"),
        (
            dict(rope_scaling="llama3", position_embedding="learned_absolute"),
            "rope_scaling='llama3' needs position_embedding='rope', got 'learned_absolute'",
        ),
        (dict(rope_scaling="llama3", rope_scaling_factor=0.5), "rope_scaling_factor=0.5: expected >= 1"),
        (
            dict(rope_scaling="llama3", rope_high_freq_factor=1.0),
            "rope_high_freq_factor=1.0 must be greater than rope_low_freq_factor=1.0",
        ),
        (
            dict(rope_scaling="llama3", rope_low_freq_factor=-1.0),
            "rope_low_freq_factor=-1.0: expected a positive",
        ),
        (
            dict(rope_scaling="llama3", rope_original_max_position=0),
            "rope_original_max_position=0: expected a positive integer",
        ),
    ],
)
def test_config_errors_name_the_field(kwargs, fragment):
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**TINY, **kwargs})
    assert fragment in str(e.value)


def test_config_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**TINY, "normalization": "x", "activation": "y"})
    assert "normalization" in str(e.value) and "activation" in str(e.value)


def test_parallel_fit_problems():
    cfg = ModelConfig(**{**TINY, "num_attention_heads": 2, "num_layers": 3, "hidden_size": 32})
    problems = "\n".join(cfg.problems(tensor_parallel_size=4, pipeline_parallel_size=2))
    assert "num_attention_heads=2 is not divisible by tensor_model_parallel_size=4" in problems
    assert "num_layers=3 is not divisible by pipeline_model_parallel_size=2" in problems
    with pytest.raises(ConfigError):
        cfg.check_parallel(4, 2)


def test_from_dict_rejects_unknown_keys_and_roundtrips():
    cfg = ModelConfig(**TINY)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown model config keys \\['hiddensize'\\]"):
        ModelConfig.from_dict({**cfg.to_dict(), "hiddensize": 3})


def test_architecture_diff():
    a = ModelConfig(**TINY)
    b = ModelConfig(**{**TINY, "hidden_size": 64, "hidden_dropout": 0.1})
    # The derived FFN width changes with the hidden size; dropout does not count.
    assert a.architecture_diff(b) == ["hidden_size: 32 != 64", "ffn_hidden_size: 88 != 176"]
    # A head width set to what it is anyway is no difference; another one is.
    assert a.architecture_diff(ModelConfig(**TINY, kv_channels=8)) == []
    assert a.architecture_diff(ModelConfig(**TINY, kv_channels=16)) == ["kv_channels: 8 != 16"]
    assert a.architecture_diff(ModelConfig(**TINY, qk_layernorm=True)) == ["qk_layernorm: False != True"]
    # How the model computes is no part of its architecture.
    assert a.architecture_diff(ModelConfig(**TINY, recompute="full")) == []
    # The llama3 scaling's parameters count only where a scaling is on.
    assert a.architecture_diff(ModelConfig(**TINY, rope_scaling_factor=4.0)) == []
    scaled = ModelConfig(**TINY, rope_scaling="llama3")
    assert a.architecture_diff(scaled) == ["rope_scaling: None != 'llama3'"]
    assert scaled.architecture_diff(ModelConfig(**TINY, rope_scaling="llama3", rope_scaling_factor=4.0)) == [
        "rope_scaling_factor: 8.0 != 4.0"
    ]


def test_new_fields_keep_old_configs_and_build_their_shapes():
    """A model config saved before kv_channels, qk_layernorm and the RoPE scaling existed (an
    old checkpoint's meta.json) loads as the same model; a head width of its own and q/k norms
    give the shapes HF's Qwen3 has."""
    old = {
        k: v for k, v in ModelConfig(**TINY).to_dict().items() if not k.startswith(("kv_", "qk_", "rope_"))
    }
    assert ModelConfig.from_dict(old) == ModelConfig(**TINY)
    assert ModelConfig(**TINY).head_dim == 8 and ModelConfig(**TINY, kv_channels=16).head_dim == 16
    # hidden_size 30 is not a multiple of 4 heads: fine with a head width of its own.
    assert ModelConfig(**{**TINY, "hidden_size": 30}, kv_channels=8).problems() == []
    cfg = ModelConfig(**TINY, num_query_groups=2, kv_channels=16, qk_layernorm=True)
    shapes = {k: tuple(v.shape) for k, v in gpt.tensor_state_dict(gpt.build_policy(cfg)).items()}
    p = "decoder.layers.0.self_attention."
    assert shapes[p + "linear_qkv.weight"] == ((4 + 2 * 2) * 16, 32)
    assert shapes[p + "linear_proj.weight"] == (32, 4 * 16)
    assert shapes[p + "q_layernorm.weight"] == shapes[p + "k_layernorm.weight"] == (16,)


def test_recompute_reaches_megatron_and_both_configs():
    """``recompute: full`` is Megatron's full recompute of one layer per checkpoint; both roles'
    packaged YAMLs name the key (off); a model that takes its architecture from a folder keeps
    the run's setting."""
    on = gpt.transformer_config(ModelConfig(**TINY, recompute="full"))
    assert (on.recompute_granularity, on.recompute_method, on.recompute_num_layers) == ("full", "uniform", 1)
    off = gpt.transformer_config(ModelConfig(**TINY))
    assert off.recompute_granularity is None and off.recompute_method is None
    from importlib.resources import files

    from omegaconf import OmegaConf

    for role in ("actor", "critic"):
        section = OmegaConf.to_container(
            OmegaConf.load(str(files("aligner.configs").joinpath(f"{role}.yaml"))).model
        )
        assert section["recompute"] == "none", role
        assert ModelConfig(**section).recompute == "none"
    folder = ModelConfig(**{**TINY, "hidden_size": 64})
    run = ModelConfig(**TINY, recompute="full")
    assert folder.with_runtime_of(run) == ModelConfig(**{**TINY, "hidden_size": 64}, recompute="full")


def test_padded_vocab():
    cfg = ModelConfig(**{**TINY, "vocab_size": 14, "make_vocab_size_divisible_by": 4})
    assert (
        cfg.padded_vocab_size(1) == 16 and cfg.padded_vocab_size(2) == 16 and cfg.padded_vocab_size(3) == 24
    )


def test_swiglu_ffn_default():
    assert ModelConfig(**{**TINY, "hidden_size": 48, "num_attention_heads": 4}).ffn_size == 128
    assert ModelConfig(**{**TINY, "activation": "gelu"}).ffn_size == 128


def test_policy_shapes_and_dropout_off(device):
    model = gpt.build_policy(ModelConfig(**TINY)).to(device)
    model.train()  # dropout is 0 by default: training-mode forwards are deterministic
    tokens = torch.randint(0, 16, (3, 10), device=device)
    a, b = forward.policy_logits(model, tokens), forward.policy_logits(model, tokens)
    assert a.shape == (3, 10, 16)
    assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["megatron", "fused"])
def test_policy_is_causal(mode, device):
    model = gpt.build_policy(ModelConfig(**TINY)).eval().to(device)
    forward.set_forward(model, mode)
    tokens = torch.randint(0, 16, (2, 10), device=device)
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 16
    with torch.no_grad():
        a, b = forward.policy_logits(model, tokens), forward.policy_logits(model, changed)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_reward_head_init_and_scores_read_at_last_token():
    cfg = ModelConfig(**{**TINY, "hidden_size": 256, "num_attention_heads": 4})
    rm = gpt.build_reward_model(cfg).eval()
    head = rm.output_layer
    assert isinstance(head, gpt.ScalarHead)
    # N(0, 1/sqrt(d+1)): the sample std over 256 weights is near 1/sqrt(257) ~ 0.0624.
    assert abs(head.weight.std().item() - 1 / math.sqrt(257)) < 0.015
    assert torch.all(head.bias == 0)
    tokens = torch.randint(0, 16, (3, 8))
    lengths = torch.tensor([2, 5, 8])
    with torch.no_grad():
        full = rm(tokens, gpt.position_ids_for(tokens), attention_mask=None)[..., 0]
        scores = forward.sequence_scores(rm, tokens, lengths)
    assert torch.allclose(scores, full[torch.arange(3), lengths - 1])
    # Padding after the last token does not change the score.
    padded = tokens.clone()
    padded[0, 2:] = 0
    with torch.no_grad():
        assert torch.allclose(forward.sequence_scores(rm, padded, lengths)[0], scores[0], atol=1e-6)


def test_critic_values_and_init_from_reward_model():
    cfg = ModelConfig(**TINY)
    rm = gpt.build_reward_model(cfg).eval()
    critic = gpt.build_critic(cfg, init_from=rm).eval()
    tokens = torch.randint(0, 16, (2, 9))
    with torch.no_grad():
        values = forward.token_values(critic, tokens)
        full = rm(tokens, gpt.position_ids_for(tokens), attention_mask=None)[..., 0]
    assert values.shape == (2, 8)
    assert torch.allclose(values, full[:, :-1])  # V(0..t) is the reward model read at t


def test_critic_init_from_wrong_shape_is_refused():
    rm = gpt.build_reward_model(ModelConfig(**{**TINY, "hidden_size": 64}))
    with pytest.raises(ValueError, match="shape mismatch"):
        gpt.build_critic(ModelConfig(**TINY), init_from=rm)


def test_tied_embeddings_share_one_tensor():
    model = gpt.build_policy(ModelConfig(**{**TINY, "tie_embeddings": True}))
    assert "output_layer.weight" not in gpt.tensor_state_dict(model)


def test_gpt2_style_variant_builds():
    cfg = ModelConfig(
        **{
            **TINY,
            "normalization": "LayerNorm",
            "activation": "gelu_tanh",
            "position_embedding": "learned_absolute",
            "add_bias_linear": True,
            "tie_embeddings": True,
        }
    )
    model = gpt.build_policy(cfg)
    names = gpt.tensor_state_dict(model)
    assert "embedding.position_embeddings.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
    assert forward.policy_logits(model, torch.randint(0, 16, (1, 5))).shape == (1, 5, 16)


def test_init_from_checkpoint_checks_architecture(tmp_path):
    from aligner.models.checkpoint_io import load_weights_from, save_model_checkpoint
    from aligner.models.config import ConversionError

    cfg = ModelConfig(**TINY)
    saved = gpt.build_policy(cfg)
    save_model_checkpoint(saved, cfg, tmp_path / "ckpt", role="policy")
    fresh = gpt.build_policy(cfg)
    assert load_weights_from(fresh, cfg, tmp_path / "ckpt") == "aligner"
    tokens = torch.randint(0, 16, (2, 7))
    with torch.no_grad():
        assert torch.equal(forward.policy_logits(saved, tokens), forward.policy_logits(fresh, tokens))
    with pytest.raises(ConversionError, match="hidden_size: 64 != 32"):
        load_weights_from(
            gpt.build_policy(ModelConfig(**{**TINY, "hidden_size": 64})),
            ModelConfig(**{**TINY, "hidden_size": 64}),
            tmp_path / "ckpt",
        )
    with pytest.raises(ConversionError, match="expected a checkpoint folder with meta.json"):
        load_weights_from(fresh, cfg, tmp_path)
    if cfg.position_embedding == "rope":  # a rope model's context may be shortened, not lengthened
        short = ModelConfig(**{**TINY, "max_seq_len": cfg.max_seq_len // 2})
        assert load_weights_from(gpt.build_policy(short), short, tmp_path / "ckpt") == "aligner"
        long = ModelConfig(**{**TINY, "max_seq_len": cfg.max_seq_len * 2})
        with pytest.raises(ConversionError, match="max_seq_len"):
            load_weights_from(gpt.build_policy(long), long, tmp_path / "ckpt")


def test_build_model_by_role_and_what_the_model_carries():
    from aligner.models.config import ConversionError

    cfg = ModelConfig(**TINY)
    for role, head in gpt.ROLES.items():
        model = gpt.build_model(cfg, role)
        assert gpt.role_head(role) == head == gpt.head_of(model)
        assert gpt.config_of(model) is cfg
    other = ModelConfig(**{**TINY, "num_layers": 1})
    assert gpt.config_of(model, other) is other  # a given config wins
    with pytest.raises(
        ConversionError, match=r"role='actor': expected one of \['critic', 'policy', 'reward'\]"
    ):
        gpt.build_model(cfg, "actor")
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ConversionError, match="no aligner_head"):
        gpt.head_of(plain)
    with pytest.raises(ConversionError, match="no aligner_config"):
        gpt.config_of(plain)

"""Model config validation and the three Megatron GPT variants (single process, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from aligner import distributed
from aligner.models import gpt
from aligner.models.config import ConfigError, ModelConfig

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


def test_padded_vocab():
    cfg = ModelConfig(**{**TINY, "vocab_size": 14, "make_vocab_size_divisible_by": 4})
    assert (
        cfg.padded_vocab_size(1) == 16 and cfg.padded_vocab_size(2) == 16 and cfg.padded_vocab_size(3) == 24
    )


def test_swiglu_ffn_default():
    assert ModelConfig(**{**TINY, "hidden_size": 48, "num_attention_heads": 4}).ffn_size == 128
    assert ModelConfig(**{**TINY, "activation": "gelu"}).ffn_size == 128


def test_policy_shapes_and_dropout_off():
    model = gpt.build_policy(ModelConfig(**TINY))
    model.train()  # dropout is 0 by default: training-mode forwards are deterministic
    tokens = torch.randint(0, 16, (3, 10))
    a, b = gpt.policy_logits(model, tokens), gpt.policy_logits(model, tokens)
    assert a.shape == (3, 10, 16)
    assert torch.equal(a, b)


def test_policy_is_causal():
    model = gpt.build_policy(ModelConfig(**TINY)).eval()
    tokens = torch.randint(0, 16, (2, 10))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 16
    with torch.no_grad():
        a, b = gpt.policy_logits(model, tokens), gpt.policy_logits(model, changed)
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
        scores = gpt.sequence_scores(rm, tokens, lengths)
    assert torch.allclose(scores, full[torch.arange(3), lengths - 1])
    # Padding after the last token does not change the score.
    padded = tokens.clone()
    padded[0, 2:] = 0
    with torch.no_grad():
        assert torch.allclose(gpt.sequence_scores(rm, padded, lengths)[0], scores[0], atol=1e-6)


def test_critic_values_and_init_from_reward_model():
    cfg = ModelConfig(**TINY)
    rm = gpt.build_reward_model(cfg).eval()
    critic = gpt.build_critic(cfg, init_from=rm).eval()
    tokens = torch.randint(0, 16, (2, 9))
    with torch.no_grad():
        values = gpt.token_values(critic, tokens)
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
    assert gpt.policy_logits(model, torch.randint(0, 16, (1, 5))).shape == (1, 5, 16)


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
        assert torch.equal(gpt.policy_logits(saved, tokens), gpt.policy_logits(fresh, tokens))
    with pytest.raises(ConversionError, match="hidden_size: 64 != 32"):
        load_weights_from(
            gpt.build_policy(ModelConfig(**{**TINY, "hidden_size": 64})),
            ModelConfig(**{**TINY, "hidden_size": 64}),
            tmp_path / "ckpt",
        )
    with pytest.raises(ConversionError, match="expected a checkpoint folder with meta.json"):
        load_weights_from(fresh, cfg, tmp_path)


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

"""The policy's architecture from its init_from folder, with model.* keys as checked overrides, and
tokenizer: auto."""

from __future__ import annotations

import dataclasses
import json

import pytest

from aligner.actor.config import ActorConfig
from aligner.actor.model_source import (
    model_keys_named,
    packaged_model_config,
    resolve_model_config,
)
from aligner.config_checks import ConfigError
from aligner.models.checkpoint_io import FORMAT, VERSION
from aligner.models.config import ModelConfig
from aligner.tokenizers import resolve_tokenizer_spec

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 3,
    "hidden_size": 48,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 120,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture
def hf_folder(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    return str(d)


def test_without_init_from_the_model_section_is_the_model():
    given = ModelConfig(num_layers=3)
    assert resolve_model_config(given, None, {"num_layers"}) == (given, [])


def test_the_packaged_defaults_are_the_yaml_model_section():
    p = packaged_model_config()
    assert (p.num_layers, p.hidden_size, p.vocab_size, p.max_seq_len) == (2, 64, 14, 32)


def test_an_hf_folder_decides_the_architecture_over_the_packaged_tiny_model(hf_folder):
    cfg, applied = resolve_model_config(packaged_model_config(), hf_folder)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads) == (3, 48, 6, 2)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.ffn_size) == (120, 256, 96)
    assert applied == []


def test_set_keys_that_change_the_weights_are_refused_naming_key_values_and_file(hf_folder):
    given = dataclasses.replace(packaged_model_config(), num_layers=4, hidden_size=96)
    with pytest.raises(ConfigError) as e:
        resolve_model_config(given, hf_folder)
    msg = str(e.value)
    assert "model.num_layers=4 differs from 3" in msg and "model.hidden_size=96 differs from 48" in msg
    assert "config.json" in msg


def test_a_key_named_on_the_command_line_counts_even_at_the_packaged_value(hf_folder):
    # num_layers=2 is the packaged value: only the command line tells it was asked for.
    with pytest.raises(ConfigError, match="model.num_layers=2 differs from 3"):
        resolve_model_config(packaged_model_config(), hf_folder, {"num_layers"})


def test_equal_values_and_tunable_keys_are_accepted(hf_folder):
    given = dataclasses.replace(
        packaged_model_config(), num_layers=3, hidden_dropout=0.1, make_vocab_size_divisible_by=8
    )
    cfg, applied = resolve_model_config(given, hf_folder)
    assert cfg.num_layers == 3 and cfg.hidden_dropout == 0.1 and cfg.make_vocab_size_divisible_by == 8
    assert sorted(applied) == ["hidden_dropout=0.1", "make_vocab_size_divisible_by=8"]


def test_a_rope_context_can_be_shortened_not_lengthened(hf_folder):
    cfg, applied = resolve_model_config(packaged_model_config(), hf_folder, {"max_seq_len"})
    assert cfg.max_seq_len == 32 and applied == ["max_seq_len=32"]  # the packaged 32, asked for
    long = dataclasses.replace(packaged_model_config(), max_seq_len=512)
    with pytest.raises(ConfigError, match="model.max_seq_len=512.*at most 256"):
        resolve_model_config(long, hf_folder)


def test_this_projects_checkpoint_folder_decides_too(tmp_path):
    saved = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=20, max_seq_len=40)
    d = tmp_path / "ckpt"
    d.mkdir()
    meta = {"format": FORMAT, "version": VERSION, "role": "policy", "model_config": saved.to_dict()}
    (d / "meta.json").write_text(json.dumps(meta))
    (d / "model.safetensors").write_bytes(b"")
    assert resolve_model_config(packaged_model_config(), str(d))[0] == saved


def test_a_folder_without_a_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="meta.json.*config.json"):
        resolve_model_config(packaged_model_config(), str(tmp_path))


def test_model_keys_named_reads_hydra_overrides():
    got = model_keys_named(["model.num_layers=4", "+model.kv_channels=8", "ppo.num_steps=3", "++model.x=1"])
    assert got == {"num_layers", "kv_channels", "x"}


def test_tokenizer_auto(hf_folder, tmp_path):
    assert resolve_tokenizer_spec("auto", None) == "char"
    with pytest.raises(ValueError, match="tokenizer=auto: init_from=.* holds no tokenizer files"):
        resolve_tokenizer_spec("auto", hf_folder)  # config.json only: which tokenizer is unknown
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer_spec("auto", hf_folder) == hf_folder
    assert resolve_tokenizer_spec("char", hf_folder) == "char"
    assert ActorConfig().tokenizer == "auto"


def test_a_padded_vocabulary_is_accepted_a_smaller_one_refused():
    cfg = ActorConfig()
    cfg.model = dataclasses.replace(cfg.model, vocab_size=20)
    assert not [p for p in cfg.problems(vocab_size=14) if "vocab_size" in p]
    cfg.model = dataclasses.replace(cfg.model, vocab_size=10)
    assert any(
        "model.vocab_size=10 is smaller than the tokenizer's vocabulary (14)" in p
        for p in cfg.problems(vocab_size=14)
    )

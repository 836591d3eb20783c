"""HF conversion refuses bad input naming what is wrong: missing or malformed folders, configs
and tensors, RoPE variants and family settings it does not support, exports to a family that
cannot hold the model, and parallel sizes that do not divide it."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
import transformers
from _hf_convert import _GPT2, _WIDE_HEADS, _hf_model, _save
from safetensors.torch import load_file, save_file

from aligner.models import gpt, hf, hf_config
from aligner.models.config import ConversionError, ModelConfig

pytestmark = pytest.mark.usefixtures("one_process_world")


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

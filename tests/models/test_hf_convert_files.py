"""Our own model checkpoint format (meta.json + safetensors, across vocabulary padding and
roles), the safetensors stream writer and folder checks under it, and the conversion CLI
(aligner-convert import/export), in one process."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from _hf_convert import TOL, VOCAB, _hf_model, _logits, _our_logits, _save, _tokens
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from aligner.models import checkpoint_io, convert_cli, gpt, hf, model_files
from aligner.models.config import ConversionError, ModelConfig

pytestmark = pytest.mark.usefixtures("one_process_world")


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
# CLI
# --------------------------------------------------------------------------------------------


def test_cli_import_export_round_trip(llama_dir, tmp_path, capsys):
    ref, src = llama_dir
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    assert convert_cli.main(["import", src, str(ckpt), "--make-vocab-size-divisible-by", "8"]) == 0
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["hf_architecture"] == "LlamaForCausalLM" and meta["role"] == "policy"
    assert meta["model_config"]["make_vocab_size_divisible_by"] == 8
    assert convert_cli.main(["export", str(ckpt), str(out), "--dtype", "float32"]) == 0
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

"""Exports that load anywhere: the base model's config.json fields (ids, context length, RoPE),
its tokenizer, chat template and generation config carried; sharded safetensors with an index;
bf16 by default; model cards; ``aligner-convert export`` of every kind of checkpoint of ours
(LoRA training checkpoints merged), and its refusals. One process, tiny models."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from _export_base import RUN_LEN, check_base_kept, save_qwen_base, tokens
from _hf_convert import TOL, _logits, _our_logits
from _word_tokenizer import save_word_tokenizer
from safetensors import safe_open

from aligner.checkpoint import COMPLETE_MARKER, step_dir_name, write_json
from aligner.models import checkpoint_io, convert_cli, hf, lora, lora_io, model_files
from aligner.models.config import ConversionError

pytestmark = pytest.mark.usefixtures("one_process_world")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base") / "qwen"
    return save_qwen_base(folder), folder


def _import(folder):
    return hf.import_hf(folder, max_seq_len=RUN_LEN)  # the run's context, shorter than the base's


def test_export_keeps_the_base_config_and_files(base, tmp_path):
    ref, folder = base
    model, cfg = _import(folder)
    assert cfg.max_seq_len == RUN_LEN
    out = hf.export_hf(
        model,
        cfg,
        tmp_path / "hf",
        "Qwen2ForCausalLM",
        dtype="fp32",
        hf_config=folder,
        tokenizer_dir=folder,
        model_card="---\nlibrary_name: transformers\n---\n# card\n",
    )
    loaded = check_base_kept(out)
    t = tokens()
    assert (_logits(loaded, t) - _logits(ref, t)).abs().max().item() < TOL
    assert (out / "README.md").read_text().startswith("---\nlibrary_name: transformers")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]  # under 5GB: one file


def test_export_without_a_base_says_what_the_model_defines(base, tmp_path):
    _, folder = base
    model, cfg = _import(folder)
    out = hf.export_hf(model, cfg, tmp_path / "hf", "qwen2")
    c = json.loads((out / "config.json").read_text())
    assert c["max_position_embeddings"] == RUN_LEN and c["architectures"] == ["Qwen2ForCausalLM"]
    assert not (out / "README.md").exists() and not (out / "generation_config.json").exists()


def test_the_generation_config_comes_from_the_base_when_the_tokenizer_has_none(base, tmp_path):
    _, folder = base
    model, cfg = _import(folder)
    tok = save_word_tokenizer(tmp_path / "tok", ["only", "these", "words"])
    out = hf.export_hf(
        model, cfg, tmp_path / "hf", "qwen2", hf_config=folder, tokenizer_dir=tok, base_dir=folder
    )
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.7
    assert transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("these") == 7
    with pytest.raises(ConversionError, match="tokenizer folder .*nowhere does not exist"):
        hf.export_hf(model, cfg, tmp_path / "x", "qwen2", tokenizer_dir=tmp_path / "nowhere")
    assert not (tmp_path / "x").exists()


def test_sharded_export_loads_through_the_index(base, tmp_path):
    ref, folder = base
    model, cfg = _import(folder)
    out = hf.export_hf(
        model, cfg, tmp_path / "hf", "qwen2", dtype="bf16", hf_config=folder, max_shard_size="40KB"
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for name in shards:
        with safe_open(str(out / name), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == name
                t = f.get_tensor(k)
                assert t.dtype == torch.bfloat16
                total += t.numel() * 2
    assert index["metadata"]["total_size"] == total
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert loaded.config.dtype == torch.bfloat16 or str(loaded.config.dtype).endswith("bfloat16")
    want = ref.state_dict()
    for k, v in loaded.state_dict().items():  # the base's weights, rounded to bf16 once
        assert torch.equal(v, want[k].to(torch.bfloat16)), k


def test_sizes_and_shard_plans():
    assert model_files.parse_size("5GB") == 5 * 10**9
    assert model_files.parse_size("2GiB") == 2 * 2**30 and model_files.parse_size("500mb") == 5 * 10**8
    assert model_files.parse_size(1000) == 1000 and model_files.parse_size("1000") == 1000
    assert model_files.parse_size(None) is None
    for bad in ("5XB", "GB", 0, "-1MB", True):
        with pytest.raises(ConversionError, match="max_shard_size"):
            model_files.parse_size(bad)
    e = [("a", (10,), torch.float32), ("b", (30,), torch.float32), ("c", (5,), torch.float32)]
    assert [[n for n, *_ in s] for s in model_files.shard_plan(e, 100)] == [["a"], ["b"], ["c"]]
    assert [[n for n, *_ in s] for s in model_files.shard_plan(e, 160)] == [["a", "b"], ["c"]]
    assert len(model_files.shard_plan(e, None)) == 1


# --------------------------------------------------------------------------------------------
# aligner-convert export
# --------------------------------------------------------------------------------------------


def _training_step(root, step, *, init_from, policy=None, cfg=None, lora_policy=None, run_dir=None):
    """An actor training checkpoint's step folder as aligner.actor.checkpointing writes it."""
    actor = root / step_dir_name(step) / "actor"
    if lora_policy is not None:
        lora_io.save_lora_adapter(lora_policy, actor / "policy_lora", meta={"base_fingerprint": "x"})
    else:
        checkpoint_io.save_model_checkpoint(policy, cfg, actor / "policy", role="policy")
    config = {
        "init_from": str(init_from),
        "tokenizer": str(init_from),
        "ppo": {"advantage": "grpo", "num_steps": 10},
        "lora": {"rank": 4 if lora_policy is not None else 0},
        "optim": {"lr": 1e-5},
        "logging": {"run_dir": str(run_dir or root / "run")},
        "checkpoint": {"export_arch": None},
    }
    write_json(actor / "trainer_state.json", {"trainer": {"step": step}, "config": config})
    write_json(actor / COMPLETE_MARKER, {"step": step, "role": "actor"})
    return actor.parent


def test_cli_exports_a_full_training_checkpoint_with_the_base_config(base, tmp_path, capsys):
    ref, folder = base
    model, cfg = _import(folder)
    root = tmp_path / "ckpts"
    step_dir = _training_step(root, 4, init_from=folder, policy=model, cfg=cfg)
    run = root / "run"
    run.mkdir()
    rows = [{"step": 3, "objective/scores": 0.25, "objective/kl": 0.01}, {"step": 4, "objective/scores": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "best").symlink_to(step_dir.name)
    for i, named in enumerate((step_dir, root / "best", root, step_dir / "actor")):
        out = tmp_path / f"hf{i}"
        assert convert_cli.main(["export", str(named), str(out), "--dtype", "float32"]) == 0, named
    loaded = check_base_kept(tmp_path / "hf0")
    t = tokens()
    assert (_logits(loaded, t) - _logits(ref, t)).abs().max().item() < TOL
    card = (tmp_path / "hf2" / "README.md").read_text()
    assert f'base_model: "{folder}"' in card and '- "rlhf"' in card and '- "grpo"' in card
    assert "step 4" in card and "| `objective/scores` | 0.5 |" in card and "| `objective/kl` | 0.01 |" in card
    assert convert_cli.main(["export", str(root), str(tmp_path / "sh"), "--max-shard-size", "40KB"]) == 0
    assert (tmp_path / "sh" / "model.safetensors.index.json").is_file()
    check_base_kept(tmp_path / "sh")
    # bf16 by default.
    assert convert_cli.main(["export", str(root), str(tmp_path / "bf16")]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())


def test_cli_exports_a_lora_training_checkpoint_merged(base, tmp_path):
    _, folder = base
    model, cfg = _import(folder)
    lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8.0), seed=3)
    with torch.no_grad():
        for name, p in lora.lora_parameters(model).items():
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)  # trained adapters: the merged model differs from the base
    root = tmp_path / "ckpts"
    _training_step(root, 2, init_from=folder, lora_policy=model)
    out = tmp_path / "hf"
    assert convert_cli.main(["export", str(root), str(out), "--dtype", "float32", "--peft"]) == 0
    loaded = check_base_kept(out)
    t = tokens()
    assert (_logits(loaded, t) - _our_logits(model, t)).abs().max().item() < TOL
    assert json.loads((out / "peft_adapter" / "adapter_config.json").read_text())["r"] == 4
    assert "lora" in (out / "README.md").read_text()

    # Its base moved: refused, naming --base; --base names it.
    moved = tmp_path / "moved"
    os.rename(folder, moved)
    try:
        with pytest.raises(
            ConversionError, match="does not exist here; name the base model folder with --base"
        ):
            convert_cli._run(
                convert_cli.build_parser().parse_args(["export", str(root), str(tmp_path / "x")])
            )
        assert convert_cli.main(["export", str(root), str(tmp_path / "y"), "--base", str(moved)]) == 0
        assert (tmp_path / "y" / "model.safetensors").is_file()
    finally:
        os.rename(moved, folder)


def test_cli_refuses_what_it_cannot_export(base, tmp_path, capsys):
    _, folder = base
    model, cfg = _import(folder)
    assert convert_cli.main(["export", str(folder), str(tmp_path / "o")]) == 1  # an HF folder
    err = capsys.readouterr().err
    assert f"{folder} is none of this project's checkpoints: expected a model checkpoint" in err
    root = tmp_path / "ckpts"
    step_dir = _training_step(root, 2, init_from=folder, policy=model, cfg=cfg)
    (step_dir / "actor" / COMPLETE_MARKER).unlink()
    assert convert_cli.main(["export", str(step_dir), str(tmp_path / "o")]) == 1
    assert "unfinished actor checkpoint" in capsys.readouterr().err
    write_json(step_dir / "actor" / COMPLETE_MARKER, {})
    assert convert_cli.main(["export", str(step_dir), str(tmp_path / "o"), "--max-shard-size", "lots"]) == 1
    assert "--max-shard-size='lots': expected a size" in capsys.readouterr().err
    assert convert_cli.main(["export", str(step_dir), str(tmp_path / "o"), "--peft"]) == 1
    assert "holds no LoRA adapters" in capsys.readouterr().err
    assert convert_cli.main(["export", str(tmp_path / "nothing"), str(tmp_path / "o")]) == 1
    assert "nothing does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()

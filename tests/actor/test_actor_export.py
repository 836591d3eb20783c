"""The actor's Hugging Face exports (aligner/actor/export.py): the final one, every
``checkpoint.export_interval`` steps, each new best (replacing the previous best's), with the base
model's config and files, bf16 and sharded by default settings, a model card naming the recipe and
the metrics; the checkpointer's hook; the settings' refusals. One process, a tiny model."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import transformers
from _export_base import RUN_LEN, check_base_kept, save_qwen_base
from _toy_critic import ToyCritic
from safetensors import safe_open

from aligner import distributed
from aligner.actor.checkpointing import ActorCheckpointer
from aligner.actor.config import ActorConfig
from aligner.actor.export import PolicyExporter, export_dir
from aligner.actor.run import run
from aligner.models import hf


@pytest.fixture
def world():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    distributed.initialize(distributed.ParallelConfig())
    yield
    distributed.destroy()


def _config(tmp_path, base_dir, model_cfg) -> ActorConfig:
    cfg = ActorConfig()
    cfg.init_from, cfg.tokenizer, cfg.model = str(base_dir), str(base_dir), model_cfg
    cfg.logging.run_dir = str(tmp_path / "run")
    c = cfg.checkpoint
    c.export_hf, c.export_interval, c.export_best = str(tmp_path / "out" / "qwen_hf"), 2, True
    return cfg


def test_exports_during_and_after_a_run(world, tmp_path):
    base_dir = tmp_path / "base"
    save_qwen_base(base_dir)
    policy, mcfg = hf.import_hf(base_dir, max_seq_len=RUN_LEN)
    cfg = _config(tmp_path, base_dir, mcfg)
    cfg.checkpoint.export_max_shard_size = "40KB"
    os.makedirs(cfg.logging.run_dir)
    with open(os.path.join(cfg.logging.run_dir, "metrics.jsonl"), "w") as fh:  # an earlier process's rows
        fh.write(json.dumps({"step": 1, "objective/scores": 0.1, "validation/scores": 0.05}) + "\n")
    overrides = ["+recipe=demo", "ppo.num_steps=4"]
    ex = PolicyExporter(cfg, policy, log_rank=True, overrides=overrides)

    ex.after_step(1, {"objective/scores": 0.1}, False)
    assert not (tmp_path / "out").exists()  # neither due nor best
    ex.after_step(2, {"objective/scores": 0.2, "objective/kl": 0.05, "validation/scores": 0.3}, True)
    ex.after_step(3, {"objective/scores": 0.4, "validation/scores": 0.5}, True)
    final = ex.at_end(4)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "qwen_hf",
        "qwen_hf-best",
        "qwen_hf-step_00000002",
    ]
    assert final == export_dir(cfg) and export_dir(cfg, "step", 2).name == "qwen_hf-step_00000002"

    check_base_kept(final)  # ids, context, RoPE, generation config, chat template
    best = export_dir(cfg, "best")
    check_base_kept(best)
    index = json.loads((final / "model.safetensors.index.json").read_text())  # sharded at 40KB
    shard = sorted(set(index["weight_map"].values()))[0]
    with safe_open(str(final / shard), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())  # bf16 by default

    card = (best / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: transformers" in card
    assert f'base_model: "{base_dir}"' in card and '- "ppo"' in card and '- "rlhf"' in card
    assert "step 3, the best validation score of the run so far (validation/scores 0.5)" in card
    assert "Recipe: `demo`" in card and "ppo.num_steps=4" in card
    assert "| `validation/scores` | 0.5 |" in card and "| `objective/kl` | 0.05 |" in card
    assert "| `ppo.advantage` | `gae` |" in card
    step_card = (export_dir(cfg, "step", 2) / "README.md").read_text()
    assert "The policy at step 2." in step_card and "| `validation/scores` | 0.3 |" in step_card
    cfg.tokenizer = "auto"  # as before read_inputs resolved it: init_from's tokenizer
    assert PolicyExporter(cfg, policy, log_rank=False).tokenizer_dir == str(base_dir)
    final_card = (final / "README.md").read_text()
    assert (
        "The final policy of the run (step 4)" in final_card and "| `objective/scores` | 0.4 |" in final_card
    )


def test_only_the_newest_step_exports_are_kept(world, tmp_path):
    """``checkpoint.export_keep_last=2``: each step export removes all but the newest two (by step
    number), never the best or final export nor a folder of another name beside them."""
    base_dir = tmp_path / "base"
    save_qwen_base(base_dir)
    policy, mcfg = hf.import_hf(base_dir, max_seq_len=RUN_LEN)
    cfg = _config(tmp_path, base_dir, mcfg)
    cfg.checkpoint.export_interval, cfg.checkpoint.export_keep_last = 1, 2
    out = tmp_path / "out"
    (out / "qwen_hf-step_notes").mkdir(parents=True)  # not a step export: left alone
    ex = PolicyExporter(cfg, policy, log_rank=True)
    ex.after_step(1, {"validation/scores": 0.5}, True)
    for step in (2, 3, 10):
        ex.after_step(step, {"validation/scores": 0.1}, False)
    ex.at_end(10)
    assert sorted(p.name for p in out.iterdir()) == [
        "qwen_hf",
        "qwen_hf-best",
        "qwen_hf-step_00000003",
        "qwen_hf-step_00000010",
        "qwen_hf-step_notes",
    ]


def test_a_run_exports_every_n_steps_its_best_and_its_end(tmp_path):
    """Through :func:`aligner.actor.run.run` (the toy server in process): the exporter is wired to
    the checkpointer and to the end of the run."""
    cfg = ActorConfig()
    cfg.data.task, cfg.data.num_digits, cfg.data.num_prompts = "copy", 3, 256
    cfg.generation.max_new_tokens = 4
    cfg.model.max_seq_len = 32
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 4, 16, 16, 16
    cfg.precision = "fp32"
    c = cfg.checkpoint
    c.dir, c.save_interval, c.keep_last, c.resume = str(tmp_path / "ckpt"), 0, 0, "none"
    c.export_hf, c.export_interval, c.export_best = str(tmp_path / "hf"), 3, True
    cfg.validation.interval, cfg.validation.before_train, cfg.validation.num_prompts = 2, False, 8
    cfg.logging.run_dir, cfg.logging.tensorboard, cfg.logging.progress_bar = (
        str(tmp_path / "run"),
        False,
        False,
    )
    run(cfg, critic=ToyCritic(), overrides=["+recipe=demo", "ppo.num_steps=4"])
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("hf"))
    assert names == ["hf", "hf-best", "hf-step_00000003"]
    for name in names:
        card = (tmp_path / name / "README.md").read_text()
        assert "Recipe: `demo`" in card and "objective/scores" in card
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert model.config.dtype == torch.bfloat16
    best = json.loads((tmp_path / "ckpt" / "best.json").read_text())
    assert f"The policy at step {best['step']}, the best" in (tmp_path / "hf-best" / "README.md").read_text()


def test_the_checkpointer_tells_the_exporter_of_each_step_and_new_best(tmp_path):
    cfg = ActorConfig()
    cfg.checkpoint.dir, cfg.checkpoint.save_interval, cfg.checkpoint.save_at_end = str(tmp_path), 0, False
    ck = ActorCheckpointer(
        cfg, SimpleNamespace(rank=0), SimpleNamespace(url="x"), None, print_fn=lambda *a, **k: None
    )
    saved, calls = [], []
    ck.save = lambda state: saved.append(state)
    ck.exporter = SimpleNamespace(after_step=lambda step, m, best: calls.append((step, best)))
    ck.after_step(1, {"objective/scores": 0.0}, lambda: 1, last=False)
    ck.after_step(2, {"validation/scores": 0.5}, lambda: 2, last=False)
    ck.after_step(3, {"validation/scores": 0.4}, lambda: 3, last=False)
    ck.after_step(4, {"validation/scores": 0.6}, lambda: 4, last=True)
    assert calls == [(1, False), (2, True), (3, False), (4, True)]
    assert saved == [2, 4]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"export_interval": 5}, "checkpoint.export_interval=5 needs checkpoint.export_hf"),
        ({"export_best": True}, "checkpoint.export_best=True needs checkpoint.export_hf"),
        (
            {"export_hf": "x", "export_best": True, "keep_best": False},
            "export_best=true needs checkpoint.keep_best",
        ),
        ({"export_hf": "x", "export_interval": -1}, "checkpoint.export_interval"),
        ({"export_hf": "x", "export_keep_last": -1}, "checkpoint.export_keep_last"),
        ({"export_dtype": "int8"}, "checkpoint.export_dtype"),
        ({"export_max_shard_size": "huge"}, "checkpoint.export_max_shard_size"),
    ],
)
def test_export_settings_are_checked(change, message):
    cfg = ActorConfig()
    for k, v in change.items():
        setattr(cfg.checkpoint, k, v)
    assert any(message in p for p in cfg.problems()), cfg.problems()


def test_export_best_needs_validation():
    cfg = ActorConfig()
    cfg.checkpoint.export_hf, cfg.checkpoint.export_best, cfg.validation.interval = "x", True, 0
    assert any("export_best=true needs validation.interval > 0" in p for p in cfg.problems())
    cfg.validation.interval = 10
    assert not [p for p in cfg.problems() if "export" in p]
    cfg.checkpoint.export_max_shard_size, cfg.checkpoint.export_dtype = None, "fp32"
    assert not [p for p in cfg.problems() if "export" in p]

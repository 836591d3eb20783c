"""The config checks of the actor (and those both roles share) on one process: problems named
with key, value and expectation and raised together, the optim sections, batch divisibility and
the estimators' settings, the generation engine against the parallel layout, the critic section,
and a checkpoint's estimator."""

from __future__ import annotations

import math

import pytest
from _actor_parts import ONE_RANK, tiny_run_config

from aligner.actor.config import ActorConfig, PolicyOptimConfig, validate_actor_config
from aligner.config_checks import ConfigError, Problems
from aligner.critic.config import CriticOptimConfig, build_config
from aligner.generation.config import GenerationConfig
from aligner.generation.engine import SamplingParams
from aligner.optim import OptimConfig
from aligner.tokenizers import CharTokenizer

# -- configs -----------------------------------------------------------------------------------


def test_generation_engine_and_layout_are_checked_against_the_parallel_layout():
    def problems(**over):
        cfg = tiny_run_config()
        for key, value in over.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return "\n".join(cfg.problems())

    assert "generation.engine='vllm': expected one of ['native', 'trtllm']" in problems(
        generation__engine="vllm"
    )
    msg = problems(generation__engine="trtllm", parallel__pipeline_model_parallel_size=2)
    assert "generation.engine='trtllm': expected 'native' with parallel.pipeline_model_parallel_size=2" in msg
    msg = problems(generation__engine="trtllm", generation__dtype="bf16")
    assert "generation.dtype='bf16': expected null with generation.engine=trtllm" in msg
    msg = problems(generation__engine="trtllm", generation__tensor_parallel_size=2)
    assert "generation.tensor_parallel_size=2: expected null or 1 with generation.engine=trtllm" in msg
    msg = problems(generation__tensor_parallel_size=3, parallel__tensor_model_parallel_size=2)
    assert "generation.tensor_parallel_size=3" in msg
    # The TensorRT-LLM engine's own settings are checked only when it is chosen.
    bad = tiny_run_config()
    bad.generation.trtllm.bucket_mb = -1
    assert not any("trtllm" in m for m in bad.problems())
    bad.generation.engine = "trtllm"
    assert any(m.startswith("generation.trtllm.bucket_mb=-1") for m in bad.problems())


def test_problems_name_key_value_and_expectation_and_are_raised_together():
    class Section:
        a, b, c = 0, True, 3

    p = Problems()
    p.positive_ints(Section, "s", ("a", "b", "c"))
    p.expect(False, "s.d", "x", "one of ['y']")
    assert p == [
        "s.a=0: expected a positive integer",
        "s.b=True: expected a positive integer",
        "s.d='x': expected one of ['y']",
    ]
    with pytest.raises(ConfigError) as e:
        p.raise_if_any("thing", ConfigError)
    assert str(e.value).startswith("invalid thing (3 problem(s)):\n  s.a=0")
    Problems().raise_if_any("thing")  # nothing to report


def test_both_roles_optim_sections_are_the_one_optim_config():
    for cls in (PolicyOptimConfig, CriticOptimConfig):
        assert issubclass(cls, OptimConfig)
        assert {f for f in OptimConfig.__dataclass_fields__} <= set(cls.__dataclass_fields__)
    assert PolicyOptimConfig().lr == 1e-6 and CriticOptimConfig().lr == 1e-5  # each role's default
    bad = {"adam_beta1": 1.0, "grad_clip": -1.0, "weight_decay": -0.1}
    want = ["optim.adam_beta1=1.0", "optim.grad_clip=-1.0", "optim.weight_decay=-0.1"]
    for cls in (PolicyOptimConfig, CriticOptimConfig):
        msgs = cls(**bad).problems()
        assert all(any(m.startswith(w) for m in msgs) for w in want), msgs
        for off in (None, 0.0):  # null and 0 both turn clipping off, in both roles
            assert cls(grad_clip=off).problems() == []
    assert OptimConfig(lr=2e-3, adam_beta1=0.8).adamw() == {
        "lr": 2e-3,
        "betas": (0.8, 0.999),
        "eps": 1e-5,
        "weight_decay": 0.0,
    }


def test_actor_and_critic_configs_report_their_optim_problems_the_same_way():
    cfg = tiny_run_config()
    cfg.optim.adam_eps = 0.0
    cfg.generation.top_p = 2.0
    with pytest.raises(ConfigError) as actor:
        validate_actor_config(cfg, vocab_size=14)
    with pytest.raises(ConfigError) as critic:
        build_config({"optim": {"adam_eps": 0.0}})
    for e in (actor, critic):
        assert "optim.adam_eps=0.0: expected > 0" in str(e.value)
    assert "generation.top_p=2.0: expected a number in (0, 1]" in str(actor.value)


def test_actor_config_reports_bad_values_and_batch_divisibility_together():
    cfg = tiny_run_config()
    assert cfg.problems(world_size=1, vocab_size=14) == []
    cfg.ppo.kl_estimator, cfg.ppo.global_batch_size, cfg.ppo.mini_batch_size = "k9", 100, 64
    assert cfg.problems(world_size=1, vocab_size=14) == [
        "ppo.kl_estimator='k9': expected 'k1', 'abs' or 'k3'",
        "ppo.global_batch_size (100) must be divisible by ppo.mini_batch_size (64)",
    ]
    cfg.ppo.mini_batch_size = 0  # an invalid size is reported as such, not divided by
    assert cfg.problems(world_size=1, vocab_size=14) == [
        "ppo.mini_batch_size=0: expected a positive integer",
        "ppo.kl_estimator='k9': expected 'k1', 'abs' or 'k3'",
    ]


def test_estimator_settings_are_checked_with_key_value_and_expectation():
    cfg = tiny_run_config()
    p = cfg.ppo
    p.advantage, p.samples_per_prompt, p.critic_warmup_steps = "grpo", 1, 3
    p.overlong_buffer, p.overlong_penalty, p.max_generation_rounds = 9, -1.0, 0
    assert cfg.problems(world_size=1, vocab_size=14) == [
        "ppo.samples_per_prompt=1: expected >= 2 with ppo.advantage='grpo' (it compares the samples of one prompt)",
        "ppo.max_generation_rounds=0: expected a positive integer",
        "ppo.critic_warmup_steps=3: expected 0 with ppo.advantage='grpo' (only 'gae' has a critic to warm up)",
        "ppo.overlong_buffer=9: expected at most generation.max_new_tokens=8 (0 turns the penalty off)",
        "ppo.overlong_penalty=-1.0: expected a finite number >= 0",
    ]
    cfg = tiny_run_config()
    p = cfg.ppo
    p.advantage, p.samples_per_prompt = "ppo", 3
    p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 48, 16, 8
    assert cfg.problems(world_size=2, vocab_size=14) == [
        "ppo.advantage='ppo': expected one of ['gae', 'grpo', 'rloo', 'reinforce_pp']",
        "ppo.mini_batch_size per data-parallel rank (8) must be divisible by ppo.samples_per_prompt (3): "
        "each rank's minibatches hold whole groups",
    ]
    cfg.ppo.dynamic_sampling = True
    assert (
        "ppo.dynamic_sampling=True: expected false with ppo.advantage='ppo' (it drops groups of equal scores: "
        "'grpo' or 'rloo' only)" in cfg.problems(world_size=2, vocab_size=14)
    )
    cfg.ppo.dynamic_sampling = False
    # 6 samples in groups of 2 over 2 ranks: 3 samples a rank, a group would straddle two ranks
    p.advantage, p.samples_per_prompt = "grpo", 2
    p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 6, 6, 3
    assert cfg.problems(world_size=2, vocab_size=14) == [
        "ppo.global_batch_size per data-parallel rank (3) must be divisible by ppo.samples_per_prompt (2): each "
        "rank generates whole groups of one prompt's samples",
        "ppo.mini_batch_size per data-parallel rank (3) must be divisible by ppo.samples_per_prompt (2): "
        "each rank's minibatches hold whole groups",
    ]
    ok = tiny_run_config()
    ok.ppo.advantage, ok.ppo.samples_per_prompt = "rloo", 4
    ok.ppo.global_batch_size, ok.ppo.mini_batch_size, ok.ppo.micro_batch_size = 64, 32, 16
    assert ok.problems(world_size=2, vocab_size=14) == []
    ok.ppo.samples_per_prompt = 32  # 64 samples over 2 ranks: 32 each, one group per rank...
    assert ok.problems(world_size=2, vocab_size=14) == [  # ...but minibatches of 16 a rank would split it
        "ppo.mini_batch_size per data-parallel rank (16) must be divisible by ppo.samples_per_prompt (32): "
        "each rank's minibatches hold whole groups"
    ]
    ok.ppo.mini_batch_size = 64
    assert ok.problems(world_size=2, vocab_size=14) == []
    ok.ppo.samples_per_prompt = 64  # a group cannot span two ranks
    assert ok.problems(world_size=2, vocab_size=14) == [
        "ppo.global_batch_size per data-parallel rank (32) must be divisible by ppo.samples_per_prompt (64): each "
        "rank generates whole groups of one prompt's samples",
        "ppo.mini_batch_size per data-parallel rank (32) must be divisible by ppo.samples_per_prompt (64): "
        "each rank's minibatches hold whole groups",
    ]


def test_gae_refuses_a_reward_only_server_and_checkpoints_keep_their_estimator():
    from aligner.actor.checkpointing import config_differences
    from aligner.actor.critic_link import server_mode_problem
    from aligner.wire.protocol import ServerInfo

    info = ServerInfo(1, 14, 32, "char", "f", -1, 8, 8)
    assert info.critic  # a server older than the field holds a critic
    for adv in ("gae", "grpo", "rloo", "reinforce_pp"):
        assert server_mode_problem(adv, info, "grpc://x:1") is None
    info.critic = False
    assert server_mode_problem("grpo", info, "grpc://x:1") is None
    assert server_mode_problem("gae", info, "grpc://x:1").startswith(
        "ppo.advantage='gae' needs the critic's values and trains the critic, but the server at grpc://x:1 "
        "runs mode=reward_only"
    )
    cfg, tok = tiny_run_config(), CharTokenizer()
    saved = {
        "model_config": cfg.model.to_dict(),
        "tokenizer": "char",
        "tokenizer_fingerprint": tok.fingerprint(),
        "tensor_model_parallel_size": 1,
        "precision": "fp32",
        "config": {"ppo": {"advantage": "grpo"}},
    }
    assert config_differences(saved, cfg, ONE_RANK, tok, "fp32") == [
        "ppo.advantage: the checkpoint was made by a run without a critic (ppo.advantage='grpo'), this run is "
        "one with a critic (ppo.advantage='gae'); resume with ppo.advantage='grpo', or start fresh"
    ]
    cfg.ppo.advantage = "rloo"  # another critic-free estimator resumes
    assert config_differences(saved, cfg, ONE_RANK, tok, "fp32") == []
    del saved["config"]  # a checkpoint older than the key was made with a critic
    assert (
        "ppo.advantage: the checkpoint was made by a run with a critic"
        in config_differences(saved, cfg, ONE_RANK, tok, "fp32")[0]
    )


def test_critic_section_reports_bad_waits_restart_policy_and_token_file(tmp_path):
    cfg = tiny_run_config()
    cfg.critic.wait_timeout_s, cfg.critic.on_restart, cfg.critic.max_restarts = 0.0, "retry", -1
    cfg.critic.run_token_file = str(tmp_path / "absent")
    problems = cfg.problems(world_size=1, vocab_size=14)
    assert problems == [
        "critic.wait_timeout_s=0.0: expected a finite number of seconds > 0",
        "critic.max_restarts=-1: expected an integer >= 0",
        "critic.on_restart='retry': expected one of ['resume', 'fail']",
        f"critic.run_token_file='{tmp_path / 'absent'}': expected an existing file (or null: "
        "$ALIGNER_RUN_TOKEN, else no token)",
    ]
    defaults = ActorConfig().critic
    assert (defaults.on_restart, defaults.max_restarts, defaults.wait_timeout_s) == ("resume", 3, 600.0)


def test_generation_config_builds_the_engines_sampling_params():
    g = GenerationConfig(max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, stop_strings=["9"])
    sp = g.sampling(seed=11)
    assert sp == SamplingParams(
        max_new_tokens=5, temperature=0.7, top_k=3, top_p=0.9, stop_strings=("9",), seed=11
    )
    assert g.sampling(greedy=True, seed=0).greedy
    # Every setting the two share by name is carried over, and nothing else is shared by accident.
    shared = set(GenerationConfig.__dataclass_fields__) & set(SamplingParams.__dataclass_fields__)
    assert shared == {"max_new_tokens", "temperature", "top_k", "top_p", "stop_strings", "stop_token_ids"}
    assert GenerationConfig(temperature=math.nan, num_threads=0).problems() == [
        "generation.temperature=nan: expected a finite number > 0",
        "generation.num_threads=0: expected an integer >= 1 or null",
    ]

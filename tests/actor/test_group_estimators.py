"""Critic-free estimators end to end, through one real server in reward-only mode, and the critic
warm-up against the real critic service.

One module-scoped server (``mode=reward_only``, copy reward) serves every run of this module:
GRPO and RLOO each learn the 3-digit copy task from under 0.3 (groups of 8 and 16 samples per
prompt, 512 samples a step, the default KL coefficient): GRPO to a best 5-step mean of 0.8 or more
(measured: by step ~41), RLOO, slower and more spread over seeds in fp32, to 0.5 or more
(REINFORCE++ by ~33); GRPO with the sign
of its advantages flipped stays low; dynamic sampling drops groups of equal scores and generates
again; a critic-free checkpoint resumes without the server; the server answers values of zeros,
says ``critic: false`` and refuses ``critic_train``, and an actor that needs the critic ('gae')
is refused at start. The critic warm-up runs in one process
against :class:`~aligner.critic.service.CriticService` (a real critic and its value update,
without the wire): its steps leave the policy bit for bit as it was and train the critic.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from _actor_parts import tiny_run_config
from _actor_runs import best_window, run_actor

from aligner.checkpoint import complete_steps
from aligner.critic.launch import start_server

ROOT = Path(__file__).resolve().parents[2]

# The copy task with 3 digits (the e2e tests' FAST settings), 512 samples a step in one minibatch.
COPY = [
    "data.task=copy",
    "data.num_digits=3",
    "generation.max_new_tokens=4",
    "ppo.global_batch_size=512",
    "ppo.mini_batch_size=512",
    "ppo.micro_batch_size=512",
    "optim.lr=4e-3",
    "optim.min_lr=4e-3",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "validation.interval=0",
    "validation.before_train=false",
]


@pytest.fixture(scope="module")
def reward_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_only")
    server = start_server(
        [
            "mode=reward_only",
            "server.grpc_port=0",
            "server.metrics_port=null",
            "model.max_seq_len=16",
            "reward.fn=aligner.tasks.digits:copy_reward",
            f"log.dir={root / 'server'}",
            "checkpoint.save_on_sigterm=false",
            "log.tensorboard=false",
        ],
        log_path=root / "server.log",
    )
    with server:
        yield server


def _scores(rows: list[dict]) -> list[float]:
    return [round(r["objective/scores"], 2) for r in rows]


@pytest.mark.slow
@pytest.mark.server
def test_grpo_learns_copy_without_a_critic_and_resumes_without_the_server(reward_server, tmp_path, capfd):
    run = tmp_path / "run"
    rows = run_actor(
        reward_server.url,
        run,
        ["ppo.advantage=grpo", "ppo.samples_per_prompt=8", "ppo.num_steps=50", *COPY],
    )
    assert len(rows) == 50 and rows[0]["objective/scores"] < 0.3
    assert best_window(rows) >= 0.8, _scores(rows)
    out = capfd.readouterr().out
    assert "ppo: advantage estimator grpo (std-normalised), 8 sample(s) per prompt; critic-free" in out
    # The copies of a prompt drew different responses from the start: the groups had something to
    # compare. No critic metrics, no critic training on the server.
    assert rows[0]["rollout/group_score_std"] > 0.05
    assert "critic/vf_explained_var" not in rows[-1] and "critic/vf_loss" not in rows[-1]
    # The end's checkpoint is the actor's alone, and a longer run continues from it.
    ckpt = run / "checkpoints"
    assert complete_steps(ckpt, role="actor") == [50] and complete_steps(ckpt, role="critic") == []
    more = run_actor(
        reward_server.url,
        run,
        ["ppo.advantage=grpo", "ppo.samples_per_prompt=8", "ppo.num_steps=51", *COPY],
    )
    assert [r["step"] for r in more][-2:] == [50, 51]
    assert "resume=auto: resuming from step 50" in capfd.readouterr().out
    assert more[-1]["objective/scores"] >= 0.8


@pytest.mark.slow
@pytest.mark.server
def test_rloo_learns_copy_without_a_critic(reward_server, tmp_path):
    """In fp32 on every machine (``precision: auto`` picks bf16 only where the CPU has it). Measured
    in fp32 over seeds 1234 (this test's), 1, 2, 3 and 4: the first step scores 0.05-0.06, and the
    best 5-step mean by step 55 is 0.69, 0.83, 0.69, 0.89 and 0.99 (seed 1234 first reaches 0.8
    only after step 80, seed 2 at step 60): asked for 0.5, against under 0.2 for GRPO with its
    sign flipped."""
    rows = run_actor(
        reward_server.url,
        tmp_path / "run",
        [
            "ppo.advantage=rloo",
            "ppo.samples_per_prompt=16",
            "ppo.num_steps=55",
            "precision=fp32",
            "checkpoint.save_at_end=false",
            *COPY,
        ],
    )
    assert rows[0]["objective/scores"] < 0.3
    assert best_window(rows) >= 0.5, _scores(rows)


@pytest.mark.slow
@pytest.mark.server
def test_reinforce_pp_learns_copy_with_one_sample_per_prompt(reward_server, tmp_path):
    """In fp32 on every machine (``precision: auto`` picks bf16 only where the CPU has it, and the
    curves differ). Measured in fp32 over seeds 1-6 and 1234: the 5-step mean first reaches 0.8 at
    steps 27-47 (1234, this test's seed, is the slowest); by step 70 every seed's best window is
    0.88 or more."""
    rows = run_actor(
        reward_server.url,
        tmp_path / "run",
        [
            "ppo.advantage=reinforce_pp",
            "ppo.num_steps=70",
            "precision=fp32",
            "checkpoint.save_at_end=false",
            *COPY,
        ],
    )
    assert rows[0]["objective/scores"] < 0.3
    assert best_window(rows) >= 0.8, _scores(rows)
    assert "rollout/group_score_std" not in rows[-1] and "rollout/overlong_filtered" not in rows[-1]


@pytest.mark.slow
@pytest.mark.server
def test_dynamic_sampling_generates_again_for_the_groups_it_drops(reward_server, tmp_path):
    """With overlong filtering on (it leaves the unfinished responses out of the loss)."""
    rows = run_actor(
        reward_server.url,
        tmp_path / "run",
        [
            "ppo.advantage=grpo",
            "ppo.samples_per_prompt=8",
            "ppo.dynamic_sampling=true",
            "ppo.max_generation_rounds=3",
            "ppo.overlong_filtering=true",
            "ppo.num_steps=4",
            "checkpoint.save_at_end=false",
            *COPY,
        ],
    )
    # At the start many groups of 8 score 0 throughout (measured: 22 of 64 in the first round):
    # they are dropped, and a second round fills the batch.
    first = rows[0]
    assert first["rollout/filtered_groups"] > 0 and first["rollout/generation_rounds"] == 2
    assert all(1 <= r["rollout/generation_rounds"] <= 3 for r in rows)
    assert all(r["rollout/group_score_std"] > 0.05 for r in rows)
    # Overlong filtering: the responses that ran to the limit without end-of-sequence left the loss.
    assert all(r["rollout/overlong_filtered"] == pytest.approx(1 - r["rollout/ended_fraction"]) for r in rows)
    assert first["rollout/overlong_filtered"] > 0.1


@pytest.mark.slow
@pytest.mark.server
def test_grpo_with_the_wrong_sign_stays_low(reward_server, tmp_path, monkeypatch):
    from aligner import rl

    real = rl.grpo_advantages

    def flipped(*a, **k):
        return -real(*a, **k)

    monkeypatch.setattr(rl, "grpo_advantages", flipped)
    rows = run_actor(
        reward_server.url,
        tmp_path / "run",
        [
            "ppo.advantage=grpo",
            "ppo.samples_per_prompt=8",
            "ppo.num_steps=30",
            "checkpoint.save_at_end=false",
            *COPY,
        ],
    )
    assert best_window(rows) < 0.2, _scores(rows)
    assert rows[-1]["objective/kl"] > 0.05  # not for lack of updates: the policy moved


@pytest.mark.server
def test_the_reward_only_server_scores_refuses_training_and_a_gae_actor(reward_server, tmp_path):
    from aligner.critic.testing import digit_batch, train_arrays
    from aligner.tasks.digits import copy_reward
    from aligner.tokenizers import CharTokenizer
    from aligner.wire.client import RemoteCriticClient
    from aligner.wire.errors import CriticRequestError

    tok = CharTokenizer()
    tokens, lengths, pl, prompts, responses = digit_batch(tok, 4, seed=0)
    with RemoteCriticClient(reward_server.url, timeout_s=30) as client:
        info = client.server_info()
        assert info.critic is False and info.checkpoint_steps == [] and info.extra["mode"] == "reward_only"
        values, rewards = client.infer(tokens, lengths, pl).result()
        assert values.shape == (4, tokens.shape[1] - 1) and not values.any()
        np.testing.assert_allclose(rewards, copy_reward(prompts, responses), atol=1e-6)
        returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=0)
        with pytest.raises(CriticRequestError, match="critic_train: field 'mode'.*got mode=reward_only"):
            client.train(tokens, lengths, returns, old_values, mask, 1).result()
    with pytest.raises(Exception, match="ppo.advantage='gae' needs the critic's values.*mode=reward_only"):
        run_actor(reward_server.url, tmp_path / "gae", ["ppo.num_steps=1", *COPY])


# -- the critic warm-up, against the real critic service in this process ------------------------


class LocalCritic:
    """A :class:`~aligner.critic.service.CriticService` held in-process, as the actor's critic
    handle (the client's calls without the wire)."""

    url = "local://critic"

    def __init__(self, service) -> None:
        self.service = service

    def server_info(self):
        return self.service.info()

    def check_compatible(self, vocab_size, max_seq_len, tokenizer_fingerprint) -> None:
        return None

    def infer(self, tokens, lengths, prompt_lengths, step=None, **texts) -> Future:
        out = self.service.infer(tokens.numpy(), lengths.numpy(), prompt_lengths.numpy())
        return _done((out.values, out.rewards))

    def train(self, tokens, lengths, returns, old_values, mask, step) -> Future:
        arrays = [x.numpy() for x in (tokens, lengths, returns, old_values, mask)]
        return _done(self.service.train(*arrays, step))

    def save(self, step: int) -> None:
        self.service.save(step)

    def load(self, step: int) -> None:
        self.service.load(step)

    def close(self) -> None:
        return None


def _weights(model) -> dict[str, torch.Tensor]:
    from aligner.models.gpt import tensor_state_dict

    return {k: v.detach().clone() for k, v in tensor_state_dict(model).items()}


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


@pytest.mark.slow
def test_critic_warmup_trains_the_critic_and_leaves_the_policy_bit_for_bit(tmp_path):
    from aligner.actor.config import validate_actor_config
    from aligner.actor.prompts import PromptSampler
    from aligner.actor.trainer import PPOTrainer
    from aligner.critic.config import build_config
    from aligner.critic.service import CriticService
    from aligner.critic.testing import tiny_config
    from aligner.distributed import ParallelConfig, destroy, initialize
    from aligner.generation.native import NativeEngine
    from aligner.metrics import MetricsLogger
    from aligner.models import gpt
    from aligner.tasks import get_task
    from aligner.tokenizers import CharTokenizer
    from aligner.wire.handle import CriticHandle

    tok = CharTokenizer()
    cfg = tiny_run_config()
    cfg.data.task, cfg.data.num_digits, cfg.generation.max_new_tokens = "copy", 3, 4
    p = cfg.ppo
    p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 3, 32, 32, 32
    p.critic_warmup_steps, p.adaptive_kl = 2, True
    cfg.precision, cfg.logging.tensorboard, cfg.logging.run_dir = "fp32", False, str(tmp_path / "run")
    validate_actor_config(cfg, vocab_size=tok.vocab_size)
    state = initialize(ParallelConfig(), seed=cfg.seed)
    try:
        service = CriticService(build_config(tiny_config(tmp_path / "critic")), state)
        critic = LocalCritic(service)
        assert isinstance(critic, CriticHandle)
        policy = gpt.build_policy(cfg.model)
        reference = gpt.build_policy(cfg.model)
        gpt.load_state_dict_strict(reference, gpt.tensor_state_dict(policy), what="reference model")
        reference.eval().requires_grad_(False)
        engine = NativeEngine(policy, tok, parallel_state=state, vocab_size=tok.sample_vocab_size)
        sampler = PromptSampler(get_task("copy", 3).prompts(256, seed=cfg.seed), 32, 0, 1, cfg.seed)
        logger = MetricsLogger(cfg.logging.run_dir, tensorboard=False)
        trainer = PPOTrainer(cfg, state, policy, reference, engine, critic, tok, sampler, logger)
        before, critic_before = _weights(policy), _weights(service.critic)
        kl_before, lr_before = trainer.kl_ctl.value, trainer.scheduler.last_epoch
        warm = [trainer.step(), trainer.step()]
        trainer.finish()
        after = _weights(policy)
        assert all(torch.equal(before[k], after[k]) for k in before)  # the policy did not move, bit for bit
        assert (trainer.kl_ctl.value, trainer.scheduler.last_epoch) == (kl_before, lr_before)
        assert service.critic_step == 2  # the critic trained on both warm-up steps
        assert any(not torch.equal(critic_before[k], v) for k, v in _weights(service.critic).items())
        assert [m["ppo/critic_warmup"] for m in warm] == [1.0, 1.0] and "loss/policy" not in warm[0]
        assert trainer.training_state()["step"] == 2  # a warm-up step is checkpointed like any other
        last = trainer.step()  # warm-up over: the policy moves
        trainer.finish()
        assert last["ppo/critic_warmup"] == 0.0 and "loss/policy" in last
        assert any(not torch.equal(after[k], v) for k, v in _weights(policy).items())
        assert service.critic_step == 3 and trainer.scheduler.last_epoch > lr_before
        logger.close()
    finally:
        destroy()

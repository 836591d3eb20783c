"""Device hygiene of the actor, on a CPU-only machine: a whole PPO step of the real trainer
(rollout log-probs, the critic's answers arriving, rewards, advantages, the policy update,
validation, the metrics) with the policy, the reference and every tensor of the step on the
``meta`` device standing in for CUDA (tests/_device_check.py). A CPU tensor meeting a device
tensor anywhere in the step raises here, as it would on a GPU.

Not covered: dynamic sampling, whose batch shape follows from the scores' values (which a device
without data cannot give). The engine and the critic are stand-ins that answer on the device and in NumPy, as the native
engine and the wire client do: what is checked is what the trainer does with their answers."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from _actor_parts import tiny_run_config
from _device_check import DEVICE, meta_host_reads

from aligner.actor.config import validate_actor_config
from aligner.actor.prompts import PromptSampler
from aligner.actor.trainer import PPOTrainer
from aligner.distributed import ParallelConfig, destroy, initialize
from aligner.generation.engine import GenerationOutput
from aligner.metrics import MetricsLogger
from aligner.models import gpt
from aligner.tasks import get_task
from aligner.tokenizers import CharTokenizer
from aligner.wire.protocol import PROTOCOL_VERSION, ServerInfo, TrainResult
from aligner.wire.protocol.validation import as_numpy


class DeviceEngine:
    """Answers every prompt with ``n`` new tokens, on the policy's device (no sampling: the
    values are not read on a device without data)."""

    def __init__(self, n: int) -> None:
        self.n, self.refits = n, 0

    def refit(self, policy) -> None:
        self.refits += 1

    def generate(self, prompts: list[list[int]], sampling) -> GenerationOutput:
        b, p = len(prompts), max(len(x) for x in prompts)
        s = p + self.n
        return GenerationOutput(
            tokens=torch.zeros(b, s, dtype=torch.int64, device=DEVICE),
            lengths=torch.full((b,), s, dtype=torch.int64, device=DEVICE),
            prompt_lengths=torch.full((b,), p, dtype=torch.int64, device=DEVICE),
            logprobs=torch.zeros(b, s - 1, device=DEVICE),
            ended=torch.ones(b, dtype=torch.bool, device=DEVICE),
        )


class NumpyCritic:
    """A critic handle that answers in NumPy and reads what it is sent as NumPy (through the
    wire's own conversion), as the client does."""

    url = "http://stand-in"

    def __init__(self, info: ServerInfo) -> None:
        self.info, self.trained = info, []

    def server_info(self) -> ServerInfo:
        return self.info

    def check_compatible(self, vocab_size, max_seq_len, tokenizer_fingerprint) -> None:
        return None

    def infer(self, tokens, lengths, prompt_lengths, step=None, **texts) -> Future:
        b, s = as_numpy(tokens).shape
        as_numpy(lengths), as_numpy(prompt_lengths)
        return _done((np.zeros((b, s - 1), np.float32), np.zeros(b, np.float32)))

    def train(self, tokens, lengths, returns, old_values, mask, step) -> Future:
        self.trained.append([as_numpy(x).shape for x in (tokens, lengths, returns, old_values, mask)])
        return _done(TrainResult(loss=0.0, grad_norm=0.0, applied_step=step))

    def save(self, step: int) -> None:
        return None

    def load(self, step: int) -> None:
        return None

    def close(self) -> None:
        return None


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


@pytest.fixture(scope="module")
def world():
    state = initialize(ParallelConfig(), seed=3)
    try:
        yield dataclasses.replace(state, device=DEVICE)
    finally:
        destroy()


@pytest.mark.parametrize(
    "advantage, extra",
    [
        ("gae", {"normalize_scores": True, "missing_eos_penalty": -1.0, "tis_cap": 2.0}),
        ("grpo", {"samples_per_prompt": 2, "overlong_filtering": True}),
        ("reinforce_pp", {"overlong_buffer": 2, "init_kl_coef": 0.0, "adaptive_kl": False}),
    ],
)
def test_a_ppo_step_keeps_every_tensor_on_the_device(world, tmp_path, advantage, extra):
    tok = CharTokenizer()
    cfg = tiny_run_config()
    cfg.data.task, cfg.data.num_digits, cfg.generation.max_new_tokens = "copy", 3, 4
    p = cfg.ppo
    p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 8, 4, 2
    p.advantage, p.adaptive_kl = advantage, True
    for k, v in extra.items():
        setattr(p, k, v)
    cfg.precision, cfg.logging.tensorboard, cfg.logging.run_dir = "fp32", False, str(tmp_path / "run")
    cfg.validation.num_samples = 2
    validate_actor_config(cfg, vocab_size=tok.vocab_size)
    # A padded vocabulary (as every real tokenizer has): the log-probs mask the padding columns.
    assert cfg.model.padded_vocab_size(1) > tok.sample_vocab_size

    policy = gpt.build_policy(cfg.model).to(DEVICE)
    reference = None  # without a KL penalty: no reference (validation's KL is then zeros)
    if p.init_kl_coef > 0 or p.adaptive_kl:
        reference = gpt.build_policy(cfg.model).to(DEVICE).eval().requires_grad_(False)
    info = ServerInfo(
        PROTOCOL_VERSION, tok.vocab_size, 64, "char", tok.fingerprint(), -1, 64, 64, critic=advantage == "gae"
    )
    critic = NumpyCritic(info)
    prompts = get_task("copy", 3).prompts(64, seed=cfg.seed)
    sampler = PromptSampler(prompts, 8, 0, 1, cfg.seed, samples_per_prompt=p.samples_per_prompt)
    logger = MetricsLogger(cfg.logging.run_dir, tensorboard=False)
    engine = DeviceEngine(4)
    try:
        with meta_host_reads():
            trainer = PPOTrainer(
                cfg, world, policy, reference, engine, critic, tok, sampler, logger, val_prompts=prompts[:2]
            )
            metrics = trainer.step()
            metrics.update(trainer.validate(1))
            trainer.finish()
    finally:
        logger.close()
    assert all(t.device == DEVICE for t in policy.parameters())
    # Refitted for the step, then for validation after the update.
    assert engine.refits == 2 and "loss/policy" in metrics and "validation/scores" in metrics
    assert bool(critic.trained) is (advantage == "gae")  # critic-free runs send no critic_train
    assert all(isinstance(v, float) for v in metrics.values())
    # the engine's log-probs reach the loss (ppo.tis_cap) on the device too
    assert ("policy/tis_weight_mean" in metrics) is ("tis_cap" in extra)

"""A tensor-parallel (TP=2) critic server under torchrun answers like the same critic at TP=1."""

from __future__ import annotations

import numpy as np
import pytest

from aligner.checkpoint import complete_steps
from aligner.critic.config import build_config
from aligner.critic.launch import start_server
from aligner.critic.service import CriticService
from aligner.critic.testing import (
    TINY_MODEL,
    digit_batch,
    raw_load,
    raw_save,
    raw_train,
    tiny_config,
    tiny_overrides,
    train_arrays,
)
from aligner.distributed import ParallelConfig, destroy, initialize
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import build_reward_model
from aligner.tokenizers import build_tokenizer
from aligner.wire import protocol as P
from aligner.wire.client import RemoteCriticClient

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.multiprocess]
TOK = build_tokenizer("char")


def test_tp2_server_matches_tp1(tmp_path):
    state = initialize(ParallelConfig(), seed=5)
    try:
        cfg = ModelConfig(**TINY_MODEL)
        save_model_checkpoint(build_reward_model(cfg), cfg, tmp_path / "rm", role="reward")
        reward = {"model_path": str(tmp_path / "rm"), "fn": "aligner.tasks.digits:sort_reward"}
        # The same critic at TP=1, in this process.
        # fp32 on both: TP=2 is compared with TP=1 to 1e-5 (bf16 rounds the shards' partial sums).
        reference = CriticService(
            build_config({**tiny_config(tmp_path / "tp1", reward=reward), "precision": "fp32"}), state
        )
        tokens, lengths, pl, *_ = digit_batch(TOK, 5, seed=9)
        returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=9)

        server = start_server(
            tiny_overrides(
                tmp_path / "tp2",
                **{
                    "parallel.tensor_model_parallel_size": 2,
                    "reward.model_path": tmp_path / "rm",
                    "precision": "fp32",
                },
            ),
            nproc=2,
            log_path=tmp_path / "tp2.log",
            ready_timeout_s=180,
        )
        try:
            with RemoteCriticClient(server.url, timeout_s=60) as client:
                assert client.info()["parallel"]["tensor_model_parallel_size"] == 2
                values, rewards = client.infer(tokens, lengths, pl).result()
                ref = reference.infer(tokens, lengths, pl)
                np.testing.assert_allclose(values, ref.values, rtol=0, atol=1e-5)
                np.testing.assert_allclose(rewards, ref.rewards, rtol=0, atol=1e-5)

                # One update on each: same loss, same (TP-reduced) gradient norm, same new values.
                def train(step, expected):
                    req = P.TrainRequest(tokens, lengths, returns, old_values, mask, step, expected)
                    return P.TrainResult.from_wire(raw_train(server.url, req))

                got = train(0, -1)
                want = reference.train(tokens, lengths, returns, old_values, mask, 0)
                assert got.loss == pytest.approx(want.loss, abs=1e-5)
                assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
                after, _ = client.infer(tokens, lengths, pl).result()
                np.testing.assert_allclose(
                    after, reference.infer(tokens, lengths, pl).values, rtol=0, atol=1e-4
                )
                # Save (rank 0 gathers both shards), train on, load: back to the saved values, at
                # the saved step on every rank (a stale step is fenced, the next one applies).
                raw_save(server.url, 0, 0)
                train(1, 0)
                raw_load(server.url, 0)
                np.testing.assert_array_equal(client.infer(tokens, lengths, pl).result()[0], after)
                with pytest.raises(Exception, match=r"\[critic-fenced\] critic_train step 2"):
                    train(2, 1)
                assert train(1, 0).applied_step == 1
            assert complete_steps(tmp_path / "tp2" / "ckpt", role="critic") == [0]
            assert (
                tmp_path / "tp2" / "ckpt" / "step_00000000" / "critic" / "model_tp01_pp00.safetensors"
            ).is_file()
            assert server.stop(timeout=60) == 0, server.output_tail()
        finally:
            server.kill()
    finally:
        destroy()

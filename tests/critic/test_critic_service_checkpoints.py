"""The critic service's weights in-process (no Triton): where a critic starts (a policy
checkpoint, a HF causal LM), save/load with the optimizer and every RNG state (resume is
exact), loads that fail changing nothing, and the fault points that kill the server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _critic_service import _batch, _service

from aligner.checkpoint import complete_steps
from aligner.critic.errors import CriticServiceError
from aligner.models.checkpoint_io import save_model_checkpoint
from aligner.models.config import ModelConfig
from aligner.models.gpt import tensor_state_dict
from aligner.wire import protocol as P

ROOT = Path(__file__).resolve().parents[2]


def test_critic_from_policy_keeps_trunk_and_fresh_head(pstate, tmp_path):
    from aligner.models.gpt import build_policy

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=32)
    policy = build_policy(cfg)
    save_model_checkpoint(policy, cfg, tmp_path / "policy", role="policy")
    svc = _service(pstate, tmp_path, precision="fp32", init={"policy_path": str(tmp_path / "policy")})
    assert svc.init_source == "policy"
    own = tensor_state_dict(svc.critic)
    for k, v in tensor_state_dict(policy).items():
        if not k.startswith("output_layer."):
            assert torch.equal(own[k], v), k
    assert own["output_layer.weight"].shape == (1, 32)


def test_critic_from_a_hf_causal_lm_takes_its_trunk_and_architecture(pstate, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(
        vocab_size=14,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=24,
    )
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf")
    svc = _service(pstate, tmp_path, precision="fp32", init={"policy_path": str(tmp_path / "hf")})
    assert svc.init_source == "policy" and svc.info().extra["init_source"] == "policy"
    c = svc.model_cfg  # the folder's architecture, not model.*
    assert (c.ffn_hidden_size, c.num_query_groups, c.max_seq_len, c.normalization) == (48, 2, 24, "RMSNorm")
    from aligner.models.hf import import_hf

    policy, _ = import_hf(tmp_path / "hf", role="policy")
    own = tensor_state_dict(svc.critic)
    for k, v in tensor_state_dict(policy).items():
        if not k.startswith("output_layer."):
            assert torch.equal(own[k], v), k
    assert own["output_layer.weight"].shape == (1, 32)  # the value head, fresh


def test_save_load_restores_weights_optimizer_and_bookkeeping(pstate, tmp_path):
    svc = _service(pstate, tmp_path, checkpoint={"keep_last": 2})
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    r1 = svc.train(tokens, lengths, returns, old_values, mask, 1)
    path = svc.save(1)
    assert path == tmp_path / "ckpt" / "step_00000001" / "critic"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["critic_step"] == 1 and meta["tensor_model_parallel_size"] == 1
    v_at_1 = svc.infer(tokens, lengths, pl).values
    svc.train(tokens, lengths, returns, old_values, mask, 2)
    r3 = svc.train(tokens, lengths, returns, old_values, mask, 3)
    svc.load(1)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v_at_1)
    assert svc.critic_step == 1 and svc.train(tokens, lengths, returns, old_values, mask, 1) == r1
    # Resume equals continuous: the optimiser state came back too.
    svc.train(tokens, lengths, returns, old_values, mask, 2)
    svc.save(2)
    assert svc.train(tokens, lengths, returns, old_values, mask, 3) == r3
    # keep_last prunes only the critic's own sub-directories.
    (tmp_path / "ckpt" / "step_00000002" / "actor").mkdir(parents=True)
    svc.save(3)
    svc.train(tokens, lengths, returns, old_values, mask, 4)
    svc.save(4)
    assert complete_steps(tmp_path / "ckpt", role="critic") == [3, 4]
    assert (tmp_path / "ckpt" / "step_00000002" / "actor").is_dir()
    assert not (tmp_path / "ckpt" / "step_00000001").exists()


def test_load_of_a_missing_step_changes_nothing(pstate, tmp_path):
    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, *_ = _batch(svc)
    v0 = svc.infer(tokens, lengths, pl).values
    with pytest.raises(P.ProtocolError, match="field 'step'.*complete critic checkpoint"):
        svc.load(42)
    svc.save(0)
    (tmp_path / "ckpt" / "step_00000000" / "critic" / "model_tp00_pp00.safetensors").write_bytes(b"garbage")
    with pytest.raises(CriticServiceError, match="cannot load critic step 0"):
        svc.load(0)
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v0)


def test_resume_with_dropout_is_exact(pstate, tmp_path):
    """With dropout every random state the critic's training draws from comes back with a
    checkpoint: torch's generator (hidden dropout) and Megatron's model-parallel tracker
    (attention dropout), as well as Python's and NumPy's."""
    import random

    from megatron.core import tensor_parallel

    svc = _service(pstate, tmp_path, model={"hidden_dropout": 0.2, "attention_dropout": 0.2})
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    svc.train(tokens, lengths, returns, old_values, mask, 1)
    svc.save(1)
    r2 = svc.train(tokens, lengths, returns, old_values, mask, 2)
    r3 = svc.train(tokens, lengths, returns, old_values, mask, 3)
    v3 = svc.infer(tokens, lengths, pl).values
    after = (random.random(), float(np.random.rand()))

    def step_2_after_load(reseed) -> P.TrainResult:
        svc.load(1)
        reseed()
        return svc.train(tokens, lengths, returns, old_values, mask, 2)

    def reseed_tracker_only():
        cpu = torch.get_rng_state()
        tensor_parallel.model_parallel_cuda_manual_seed(99)
        torch.set_rng_state(cpu)

    # Both generators feed the training step: hidden dropout draws from torch's generator,
    # attention dropout from the tracker.
    assert step_2_after_load(lambda: torch.manual_seed(99)) != r2
    assert step_2_after_load(reseed_tracker_only) != r2
    # Every generator somewhere else before the load, as in a restarted server.
    torch.manual_seed(99)
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    svc.load(1)
    assert svc.train(tokens, lengths, returns, old_values, mask, 2) == r2
    assert svc.train(tokens, lengths, returns, old_values, mask, 3) == r3
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v3)
    assert (random.random(), float(np.random.rand())) == after


def test_checkpoint_with_only_torch_rng_still_loads(pstate, tmp_path):
    """Checkpoints written before every RNG was saved hold torch's CPU state alone."""
    from aligner.checkpoint import load_tensors, save_tensors

    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, *_ = _batch(svc)
    path = svc.save(0)
    rng = load_tensors(path / "rng_tp00_pp00.safetensors")
    assert {"torch_cpu", "python", "numpy_keys"} <= set(rng)
    save_tensors(path / "rng_tp00_pp00.safetensors", {"torch_cpu": rng["torch_cpu"]})
    expected = torch.rand(3)
    torch.manual_seed(7)
    svc.load(0)
    assert torch.equal(torch.rand(3), expected)


def test_rng_states_are_checked_before_a_load_applies_anything(pstate, tmp_path, caplog):
    """A malformed RNG shard fails the load with nothing applied; device states that do not fit
    this process (saved on another kind of device) are left out with a warning."""
    from aligner.checkpoint import load_tensors, save_tensors

    svc = _service(pstate, tmp_path)
    tokens, lengths, pl, returns, old_values, mask, *_ = _batch(svc)
    path = svc.save(0)
    file = path / "rng_tp00_pp00.safetensors"
    rng = load_tensors(file)
    svc.train(tokens, lengths, returns, old_values, mask, 1)
    v1 = svc.infer(tokens, lengths, pl).values
    save_tensors(file, {k: v for k, v in rng.items() if k != "numpy_pos"})
    with pytest.raises(CriticServiceError, match=r"rank 0: RNG states \['numpy_pos'\] are missing"):
        svc.load(0)
    assert svc.critic_step == 1
    np.testing.assert_array_equal(svc.infer(tokens, lengths, pl).values, v1)
    # A CUDA-sized tracker state on this CPU server: the portable states come back, with a warning.
    tracker = {k: torch.zeros(16, dtype=torch.uint8) for k in rng if k.startswith("tracker.")}
    assert tracker
    save_tensors(file, {**{k: v for k, v in rng.items() if not k.startswith("tracker.")}, **tracker})
    saved = torch.Generator()
    saved.set_state(rng["torch_cpu"])
    expected = torch.rand(3, generator=saved)
    with caplog.at_level("WARNING", logger="aligner.critic"):
        svc.load(0)
    assert svc.critic_step == P.critic_step_after_load(0) and torch.equal(torch.rand(3), expected)
    cpu_state = rng["torch_cpu"].numel()  # this CPU server's tracker states are CPU generator states
    assert f"tracker.model-parallel-rng [16] here [{cpu_state}]" in caplog.text


# ------------------------------------------------------------------------------------------------
# Fault points (ALIGNER_SERVER_FAULT_AT): the server kills itself where the tests say
# ------------------------------------------------------------------------------------------------

_FAULT_SCRIPT = """
import sys
from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, tiny_config, train_arrays
from aligner.distributed import ParallelConfig, initialize

svc = CriticService(build_config(tiny_config(sys.argv[1])), initialize(ParallelConfig(), seed=1))
tokens, lengths, pl, *_ = digit_batch(svc.tokenizer, 2)
returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1])
for step in (1, 2, 3):
    svc.infer(tokens, lengths, pl)
    svc.train(tokens, lengths, returns, old_values, mask, step)
    svc.save(step)
    print("done", step, flush=True)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("fault, last_done", [("infer@2", 2), ("train@2", 1), ("save@2", 1)])
def test_fault_points_kill_the_server_where_they_say(tmp_path, fault, last_done):
    import subprocess
    import sys

    from aligner.faults import SERVER

    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", SERVER.env: fault, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _FAULT_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == -9, out.stderr[-2000:]
    assert out.stdout.split() == [w for s in range(1, last_done + 1) for w in ("done", str(s))]
    assert complete_steps(tmp_path / "ckpt", role="critic") == list(range(1, last_done + 1))
    if fault.startswith("save"):  # its shards were written, the folder never committed
        (tmp,) = (tmp_path / "ckpt" / "step_00000002").glob(".tmp.critic.*")
        assert (tmp / "model_tp00_pp00.safetensors").is_file() and not (tmp / "complete.json").exists()

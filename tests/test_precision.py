"""Mixed precision: fp32 master weights (checked, not assumed), fp32 gradients at the step,
bit-exact resume through safetensors + JSON, LR scheduling, bf16 vs fp32 forwards, and the
critic service in bf16."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from aligner.checkpoint import load_tensors, read_json, save_tensors, write_json
from aligner.critic.config import build_config
from aligner.critic.service import CriticService
from aligner.critic.testing import digit_batch, tiny_config, train_arrays
from aligner.distributed import ParallelConfig, destroy, free_port, initialize
from aligner.models.config import ModelConfig
from aligner.models.forward import policy_logits, sequence_scores, token_values
from aligner.models.gpt import (
    build_critic,
    build_policy,
    build_reward_model,
    load_state_dict_strict,
    tensor_state_dict,
)
from aligner.precision import (
    load_master_state_dict,
    make_optimizer,
    master_state_dict,
    precision_dtype,
    resolve_precision,
)
from aligner.rl import gather_logprobs

BF16, FP32 = torch.bfloat16, torch.float32
TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=14, max_seq_len=32)


@pytest.fixture(scope="module")
def ps():
    state = initialize(ParallelConfig(), seed=1234)
    yield state
    destroy()


def _linear(dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    m = nn.Linear(8, 4)
    with torch.no_grad():
        m.weight.uniform_(1.0, 2.0)  # bf16 spacing here is 2**-7 ~ 7.8e-3
    return m.to(dtype)


# -- names ----------------------------------------------------------------------------------


def test_precision_names():
    assert precision_dtype("bf16") is BF16 and precision_dtype("fp32") is FP32
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert resolve_precision("auto") == ("bf16" if native or torch.cuda.is_available() else "fp32")
    for bad in ("fp16", "bfloat16", ""):
        with pytest.raises(ValueError, match="precision="):
            resolve_precision(bad)
    with pytest.raises(ValueError, match="resolve 'auto'"):
        precision_dtype("auto")


# -- the optimizer --------------------------------------------------------------------------


def test_fp32_is_torch_adamw_bit_for_bit():
    ours_m, ref_m = _linear(FP32), _linear(FP32)
    ours = make_optimizer(ours_m, lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, precision="fp32")
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
    assert all(m is p for m, p in zip(ours.master_params, ours.model_params))  # no copies
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        for model, opt in ((ours_m, ours), (ref_m, ref)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        assert torch.equal(a, b)


def test_master_weights_are_fp32_and_keep_updates_bf16_would_lose():
    """lr 1e-3 against a bf16 spacing of 7.8e-3: an AdamW on the bf16 weights themselves never
    moves them (every update rounds away), while the fp32 masters move by ~lr per step and the
    bf16 weights follow once the masters have moved by more than half a spacing."""
    mixed_m, pure_m = _linear(BF16), _linear(BF16)
    w0 = mixed_m.weight.detach().clone()
    mixed = make_optimizer(mixed_m, lr=1e-3, precision="bf16")
    pure = torch.optim.AdamW(pure_m.parameters(), lr=1e-3, weight_decay=0.0)
    assert all(m.dtype == FP32 and p.dtype == BF16 for p, m in zip(mixed.model_params, mixed.master_params))
    assert all(m.data_ptr() != p.data_ptr() for p, m in zip(mixed.model_params, mixed.master_params))
    x = torch.ones(2, 8, dtype=BF16)
    for step in range(1, 7):
        for model, opt in ((mixed_m, mixed), (pure_m, pure)):
            opt.zero_grad()
            model(x).sum().backward()  # constant gradient: every Adam update is ~ -lr
            opt.step()
        master = mixed.master_params[0]
        # The masters hold what bf16 cannot: their rounding is the model's weight ...
        assert torch.equal(master.to(BF16), mixed_m.weight)
        assert torch.allclose(master, w0.float() - 1e-3 * step, atol=1e-5)
        if step <= 3:  # ... which has not moved yet (3e-3 < half a spacing everywhere)
            assert torch.equal(mixed_m.weight, w0)
            assert not torch.equal(master, w0.float())  # but the master has
    assert torch.equal(pure_m.weight, w0)  # pure bf16: stuck for good
    assert (mixed_m.weight != w0).float().mean() > 0.5  # mixed: most weights have moved


def test_gradients_reach_the_step_in_fp32_accumulated_in_fp32():
    """1 + 100 micro-batches of 1e-3: a bf16 accumulator stays at 1.0 (1 + 1e-3 rounds to 1);
    the fp32 master gradient reaches 1.1."""
    model = _linear(BF16)
    opt = make_optimizer(model, lr=1e-3, precision="bf16")
    seen = []
    opt.register_step_pre_hook(lambda o, *a: seen.extend((g.dtype, g.clone()) for g in _grads(o)))
    opt.zero_grad()
    x = torch.ones(1, 8, dtype=BF16)
    (model(x).sum() * 1.0).backward()
    for _ in range(100):
        (model(x).sum() * 1e-3).backward()
    assert model.weight.grad is None  # moved to the master as backward produced it
    opt.step()
    assert len(seen) == 2  # weight and bias, the step hooks ran once
    dtypes = {d for d, _ in seen}
    assert dtypes == {FP32}
    weight_grad = seen[0][1]
    c = float(torch.tensor(1e-3, dtype=BF16))
    assert torch.allclose(weight_grad, torch.full_like(weight_grad, 1 + 100 * c), rtol=1e-5)


def _grads(opt):
    return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]


def test_manual_gradients_clipping_and_a_non_finite_norm():
    model = _linear(BF16)
    opt = make_optimizer(model, lr=1e-2, precision="bf16")
    model.weight.grad = torch.full_like(model.weight, 3.0)  # set by hand: no hook ran
    model.bias.grad = torch.full_like(model.bias, 4.0)
    norm = opt.clip_grad_norm(1.0)
    assert norm == pytest.approx(math.sqrt(32 * 9 + 4 * 16))
    assert opt.master_params[0].grad.dtype == FP32 and model.weight.grad is None
    total = torch.cat([g.reshape(-1) for g in _grads(opt)]).norm()
    assert float(total) == pytest.approx(1.0, rel=1e-5)
    assert opt.step() is True
    before = [m.clone() for m in opt.master_params]
    opt.zero_grad()
    model.weight.grad = torch.full_like(model.weight, float("inf"))
    assert not math.isfinite(opt.clip_grad_norm(1.0))
    assert opt.step() is False  # skipped, nothing changed
    assert all(torch.equal(a, b) for a, b in zip(before, opt.master_params))


def test_make_optimizer_keeps_an_fp32_module_as_masters_and_casts_it(ps):
    torch.manual_seed(3)
    model = build_policy(TINY)
    fp32 = {k: v.clone() for k, v in tensor_state_dict(model).items()}
    opt = make_optimizer(model, lr=1e-3, precision="bf16")
    assert {p.dtype for p in model.parameters()} == {BF16}
    full = master_state_dict(model, opt)
    assert all(torch.equal(full[k], v) for k, v in fp32.items())  # not rounded
    with pytest.raises(ValueError, match="params_dtype"):
        make_optimizer(list(build_policy(TINY).parameters()), lr=1e-3, precision="bf16")
    with pytest.raises(ValueError, match="params_dtype"):
        make_optimizer(model, lr=1e-3, precision="fp32")


def test_resume_is_bit_exact_through_safetensors_and_json(ps, tmp_path):
    """save -> load into a fresh model, optimizer and LambdaLR -> the next steps equal the
    continuous run's, bit for bit (masters, bf16 weights and Adam moments)."""
    tokens = torch.randint(0, 14, (4, 16), generator=torch.Generator().manual_seed(0))
    target = torch.randn(4, 15, generator=torch.Generator().manual_seed(1))

    def fresh(seed):
        torch.manual_seed(seed)
        model = build_critic(TINY, params_dtype=BF16)
        opt = make_optimizer(model, lr=3e-3, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01, precision="bf16")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        return model, opt, sched

    def train(model, opt, sched, n):
        for _ in range(n):
            opt.zero_grad()
            (token_values(model, tokens) - target).square().mean().backward()
            opt.clip_grad_norm(1.0)
            assert opt.step()
            sched.step()

    model, opt, sched = fresh(0)
    train(model, opt, sched, 3)
    tensors, meta = opt.state_tensors()
    save_tensors(tmp_path / "optim.safetensors", tensors)
    save_tensors(tmp_path / "model.safetensors", master_state_dict(model, opt))
    write_json(tmp_path / "meta.json", {"optimizer": meta, "scheduler": sched.state_dict()})
    train(model, opt, sched, 3)

    saved_model = load_tensors(tmp_path / "model.safetensors")
    assert {v.dtype for v in saved_model.values()} == {FP32}  # the masters, not the bf16 rounding
    assert sum(k.startswith("master.") for k in load_tensors(tmp_path / "optim.safetensors")) == len(
        opt.master_params
    )
    model2, opt2, sched2 = fresh(1)
    saved = read_json(tmp_path / "meta.json")
    opt2.load_state_tensors(load_tensors(tmp_path / "optim.safetensors"), saved["optimizer"])
    load_master_state_dict(model2, opt2, saved_model)
    sched2.load_state_dict(saved["scheduler"])
    train(model2, opt2, sched2, 3)
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(3e-3 / 7)
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert a.dtype == BF16 and torch.equal(a, b)
    for a, b in zip(opt.master_params, opt2.master_params):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[a][k], opt2.state[b][k])


def test_lambdalr_scales_the_step():
    """The scheduler drives the lr the masters are updated with (bf16 run vs fp32 AdamW)."""
    mixed_m, ref_m = _linear(BF16), _linear(BF16).float()
    mixed = make_optimizer(mixed_m, lr=1e-2, precision="bf16")
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.0)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 0.5**i) for o in (mixed, ref)]
    for _ in range(3):
        for model, opt in ((mixed_m, mixed), (ref_m, ref)):
            opt.zero_grad()
            model.weight.grad = torch.ones_like(model.weight)
            model.bias.grad = torch.ones_like(model.bias)
            opt.step()
        for s in scheds:
            s.step()
    assert mixed.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    # The same arithmetic on the same fp32 starting values (ones are exact in bf16).
    assert torch.equal(mixed.master_params[0], ref_m.weight.detach())


def test_old_fp32_optimizer_state_loads(ps):
    """Optimizer state written by aligner.checkpoint.optimizer_to_safe (no masters) still loads."""
    from aligner.checkpoint import optimizer_to_safe

    model = _linear(FP32)
    old = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.weight.grad, model.bias.grad = torch.ones_like(model.weight), torch.ones_like(model.bias)
    old.step()
    tensors, meta = optimizer_to_safe(old)
    new = make_optimizer(model, lr=1e-2, precision="fp32")
    assert meta["param_groups"][0]["foreach"] is None  # torch's default, saved with the state
    new.load_state_tensors(tensors, json.loads(json.dumps(meta)))
    assert torch.equal(new.state[model.weight]["exp_avg"], old.state[model.weight]["exp_avg"])
    assert all(g["foreach"] is True for g in new.param_groups)  # this run's multi-tensor path kept
    bad = dict(tensors)
    with pytest.raises(Exception, match="parameter groups"):
        new.load_state_tensors(bad, {**meta, "param_groups": [{**meta["param_groups"][0], "params": [0]}]})


# -- models in bf16 -------------------------------------------------------------------------


def test_bf16_models_run_and_give_fp32_outputs_close_to_fp32(ps):
    """Same weights, bf16 vs fp32 forward. Stated tolerances on this model: logprobs within
    2e-2 (max) and 2e-3 (mean) of fp32 (docs/platform.md: logits differ by up to ~1.6e-2); values
    and scores (O(1) here) within 3e-2 (max) and 6e-3 (mean): bf16 keeps 8 bits of mantissa,
    relative steps of 2**-9 ~ 2e-3 per rounding."""
    torch.manual_seed(4)
    tokens = torch.randint(0, 14, (6, 24), generator=torch.Generator().manual_seed(2))
    lengths = torch.tensor([24, 20, 17, 24, 9, 12])
    for build, run, max_tol, mean_tol in (
        (
            build_policy,
            lambda m: gather_logprobs(policy_logits(m, tokens)[:, :-1], tokens[:, 1:], 1.0),
            2e-2,
            2e-3,
        ),
        (build_critic, lambda m: token_values(m, tokens), 3e-2, 6e-3),
        (build_reward_model, lambda m: sequence_scores(m, tokens, lengths), 3e-2, 6e-3),
    ):
        m32 = build(TINY)
        m16 = build(TINY, params_dtype=BF16)
        assert {p.dtype for p in m16.parameters()} == {BF16}  # norms and heads too
        load_state_dict_strict(m16, tensor_state_dict(m32))  # casts
        out32, out16 = run(m32), run(m16)
        assert out16.dtype == FP32
        diff = (out32 - out16).detach().abs()
        assert float(diff.max()) < max_tol and float(diff.mean()) < mean_tol, (build.__name__, diff)
        out16.sum().backward()  # backward runs in bf16 on CPU
        assert all(p.grad is not None and p.grad.dtype == BF16 for p in m16.parameters())
        # A bf16 state dict loads into an fp32 model (and gives the bf16 weights exactly).
        back = build(TINY)
        load_state_dict_strict(back, tensor_state_dict(m16))
        for k, v in tensor_state_dict(back).items():
            assert v.dtype == FP32 and torch.equal(v, tensor_state_dict(m16)[k].float())


def test_a_bf16_policy_learns_like_fp32(ps):
    """Teacher-forced next-token learning of a fixed digit-sorting batch: both precisions learn,
    and end close to each other."""
    g = torch.Generator().manual_seed(0)
    digits = torch.randint(0, 10, (16, 6), generator=g)
    tokens = torch.cat([digits, torch.full((16, 1), 10), digits.sort(dim=1).values], dim=1)  # [b, 13]
    final = {}
    for prec in ("fp32", "bf16"):
        torch.manual_seed(5)
        model = build_policy(TINY)
        opt = make_optimizer(model, lr=3e-3, precision=prec)
        first = None
        for _ in range(60):
            opt.zero_grad()
            logp = gather_logprobs(policy_logits(model, tokens)[:, 6:-1], tokens[:, 7:], 1.0)
            loss = -logp.mean()
            loss.backward()
            opt.clip_grad_norm(1.0)
            opt.step()
            first = float(loss.detach()) if first is None else first
        final[prec] = float(loss.detach())
        assert final[prec] < 0.1 * first, (prec, first, final[prec])  # ~2.65 -> ~0.075 here
    assert abs(final["bf16"] - final["fp32"]) < 0.15 * final["fp32"] + 0.05, final


# -- DP all-reduce of bf16 models in fp32 (two processes over gloo) ---------------------------


def _dp_worker(rank: int, port: int, q) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        model = _linear(BF16)
        opt = make_optimizer(model, lr=1e-3, precision="bf16")
        x = torch.ones(1, 8, dtype=BF16)
        # Rank 0: gradient 1 + 2**-9 (not a bf16 number once summed in bf16); rank 1: 1.
        (model(x).sum() * (1.0 if rank else 1.0 + 2**-9)).backward()
        opt.allreduce_grads(dist.group.WORLD, 2)
        g = opt.master_params[0].grad
        q.put((rank, str(g.dtype), float(g[0, 0])))
        dist.destroy_process_group()
    except BaseException as e:  # report, do not hang the peer
        q.put((rank, repr(e), None))


@pytest.mark.multiprocess
def test_dp_allreduce_is_fp32():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_dp_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    c = float(torch.tensor(1 + 2**-9, dtype=BF16))  # what rank 0's bf16 gradient holds
    for _rank, dtype, value in results:
        assert value is not None, dtype
        assert dtype == "torch.float32" and value == (c + 1.0) / 2


# -- the critic service in bf16 -------------------------------------------------------------


def _bf16_service(ps, root) -> CriticService:
    cfg = tiny_config(root)
    cfg["precision"] = "bf16"
    return CriticService(build_config(cfg), ps)


def _batch(svc, b=8, seed=0):
    tokens, lengths, pl, *_ = digit_batch(svc.tokenizer, b, seed=seed)
    returns, old_values, mask = train_arrays(lengths, pl, tokens.shape[1], seed=seed)
    return tokens, lengths, pl, returns, old_values, mask


def test_bf16_critic_service_learns_and_resumes_exactly(ps, tmp_path):
    svc = _bf16_service(ps, tmp_path)
    assert svc.precision == "bf16" and svc.info().extra["precision"] == "bf16"
    assert {p.dtype for p in svc.critic.parameters()} == {BF16}
    assert {m.dtype for m in svc.optimizer.master_params} == {FP32}
    tokens, lengths, pl, returns, old_values, mask = _batch(svc)
    assert svc.infer(tokens, lengths, pl).values.dtype == np.float32
    # The value loss on a fixed batch goes down (old_values = current values: unclipped regime).
    losses = []
    for step in range(6):
        v = svc.infer(tokens, lengths, pl).values
        losses.append(svc.train(tokens, lengths, returns, v, mask, step).loss)
    assert losses[-1] < 0.7 * losses[0], losses
    # Checkpoint round trip: resume equals continuous, bit for bit.
    path = svc.save(5)
    assert {t.dtype for t in load_tensors(path / "model_tp00_pp00.safetensors").values()} == {FP32}
    assert read_json(path / "meta.json")["precision"] == "bf16"
    r6 = svc.train(tokens, lengths, returns, old_values, mask, 6)
    r7 = svc.train(tokens, lengths, returns, old_values, mask, 7)
    v7 = svc.infer(tokens, lengths, pl).values
    masters7 = [m.clone() for m in svc.optimizer.master_params]
    fresh = _bf16_service(ps, tmp_path)  # a restarted server
    fresh.load(5)
    assert fresh.train(tokens, lengths, returns, old_values, mask, 6) == r6
    assert fresh.train(tokens, lengths, returns, old_values, mask, 7) == r7
    np.testing.assert_array_equal(fresh.infer(tokens, lengths, pl).values, v7)
    assert all(torch.equal(a, b) for a, b in zip(masters7, fresh.optimizer.master_params))
    # The bf16 server's checkpoint loads into an fp32 critic (its weights are the masters).
    fp32 = build_critic(svc.model_cfg)
    load_state_dict_strict(fp32, load_tensors(path / "model_tp00_pp00.safetensors"))
    assert all(v.dtype == FP32 for v in tensor_state_dict(fp32).values())


def test_an_fp32_critic_checkpoint_resumes_in_bf16_with_its_fp32_weights(ps, tmp_path):
    """A checkpoint of an fp32 server (also one written before optimizer files held masters)
    resumes a bf16 server: its fp32 weights become the masters unrounded, Adam state carries over."""
    cfg = tiny_config(tmp_path)
    cfg["precision"] = "fp32"
    svc32 = CriticService(build_config(cfg), ps)
    tokens, lengths, pl, returns, old_values, mask = _batch(svc32)
    svc32.train(tokens, lengths, returns, old_values, mask, 0)
    path = svc32.save(0)
    optim = load_tensors(path / "optim_tp00_pp00.safetensors")
    save_tensors(
        path / "optim_tp00_pp00.safetensors", {k: v for k, v in optim.items() if not k.startswith("master.")}
    )
    svc16 = _bf16_service(ps, tmp_path)
    svc16.load(0)
    want = tensor_state_dict(svc32.critic)
    got = master_state_dict(svc16.critic, svc16.optimizer)
    assert all(got[k].dtype == FP32 and torch.equal(got[k], v) for k, v in want.items())
    for a, b in zip(svc32.optimizer.master_params, svc16.optimizer.master_params):
        assert torch.equal(svc32.optimizer.state[a]["exp_avg_sq"], svc16.optimizer.state[b]["exp_avg_sq"])
    assert svc16.train(tokens, lengths, returns, old_values, mask, 1).applied_step == 1

"""Worker processes for tests/generation/test_weight_stream.py and tests/generation/test_generation_layout.py
(spawned, so they live in an importable module).

Each worker joins a gloo world and runs several layouts in one process group, tearing down
Megatron's parallel state between them (``mpu.destroy_model_parallel``) instead of launching
again. Every check is an assertion in the worker: one that fails makes
``torch.multiprocessing.spawn`` raise, which fails the test. What the test process checks
itself (transformers' logits) is written under ``out_dir`` as safetensors.
"""

from __future__ import annotations

import os
from pathlib import Path

PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [3, 3, 3, 3, 13]]
TOKENS = [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2]]
FP32_LOGPROB_TOL = 1e-5


def _init(rank: int, world: int, port: int):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)


def _layout(tp: int, pp: int, seed: int = 1234):
    """Megatron's parallel state at TP x PP (what was there before is torn down)."""
    from megatron.core import parallel_state as mpu

    from aligner import distributed

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    return distributed.initialize(
        distributed.ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, backend="gloo", timeout_s=120.0
        ),
        seed=seed,
    )


def random_weights(cfg, seed: int) -> dict:
    """Full canonical tensors of ``cfg`` (every rank makes the same): weights ~ N(0, 0.2^2),
    norm weights around 1 and biases around 0 but not at them, so a misplaced one shows."""
    import torch

    from aligner.models.layout import megatron_tensor_specs

    out = {}
    for i, spec in enumerate(megatron_tensor_specs(cfg, "lm")):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        t = torch.randn(spec.shape, generator=g)
        if "norm" in spec.name:
            t = 1.0 + 0.3 * t
        elif spec.name.endswith("bias"):
            t = 0.1 * t
        else:
            t = 0.2 * t
        out[spec.name] = t
    return out


def _policy(cfg, weights: dict, dtype=None):
    """A policy on the current layout holding ``weights`` (this rank's shards of them)."""
    import torch

    from aligner.models.gpt import build_policy
    from aligner.models.layout import load_megatron_tensors

    model = build_policy(cfg, params_dtype=dtype or torch.float32)
    load_megatron_tensors(model, cfg, weights.__getitem__)
    return model.eval()


def _all_same(t, group=None) -> bool:
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


# ----------------------------------------------------------------------------------------------
# The weight stream: TP=2, PP=2 and TP=2 x PP=2 against TP=1 (four processes)
# ----------------------------------------------------------------------------------------------


def stream_cfgs() -> dict:
    """Three architectures with an HF family each: Llama (GQA, SwiGLU, untied head, a padded
    vocabulary), Qwen2 (q/k/v biases, tied embeddings), GPT-2 (LayerNorm, learned positions,
    biases everywhere, tied)."""
    from aligner.models.config import ModelConfig

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100, max_seq_len=32)
    return {
        "llama": ModelConfig(**base, num_query_groups=2, ffn_hidden_size=96, make_vocab_size_divisible_by=8),
        "qwen2": ModelConfig(
            **base, num_query_groups=2, ffn_hidden_size=96, add_qkv_bias=True, tie_embeddings=True
        ),
        "gpt2": ModelConfig(
            **base,
            normalization="LayerNorm",
            activation="gelu_tanh",
            position_embedding="learned_absolute",
            add_bias_linear=True,
            tie_embeddings=True,
        ),
    }


def stream_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """The HF stream of the same weights at TP=2, PP=2 and TP=2 x PP=2 equals the TP=1 one,
    name for name and bit for bit, on every rank; the TP=2 x PP=2 export is written for
    transformers to load, with the TP=1 logits beside it. Then generation at TP=2 x PP=2 in
    generation groups of 2 (new groups, cut from each replica's model-parallel ranks) and of 1
    equals TP=1 generation. And LoRA (:func:`_lora_case`): the same adapters in every layout
    give the TP=1 logits and adapter gradients, and the TP=1 merged stream."""
    _init(rank, world, port)
    import torch
    from safetensors.torch import save_file

    from aligner import distributed
    from aligner.models import forward, hf

    out = Path(out_dir)
    cfgs = stream_cfgs()
    weights = {name: random_weights(cfg, seed=i + 1) for i, (name, cfg) in enumerate(cfgs.items())}
    try:
        _layout(1, 1)  # four data-parallel replicas
        expected = {}
        for name, cfg in cfgs.items():
            model = _policy(cfg, weights[name])
            expected[name] = [(k, v.clone()) for k, v in hf.iter_hf_tensors(model, cfg, name)]
            if name == "llama" and rank == 0:
                with torch.no_grad():
                    logits = forward.policy_logits(model, torch.tensor(TOKENS))[..., : cfg.vocab_size]
                save_file({"logits": logits.contiguous()}, str(out / "tp1_logits.safetensors"))
        refs = _references(cfgs["llama"], weights["llama"])
        _layout(1, 1)
        lora_ref = _lora_case(cfgs["llama"], weights["llama"])

        for tp, pp in ((2, 1), (1, 2), (2, 2)):
            _layout(tp, pp)
            _lora_case(cfgs["llama"], weights["llama"], lora_ref, (tp, pp))
            for name, cfg in cfgs.items():
                model = _policy(cfg, weights[name])
                got = list(hf.iter_hf_tensors(model, cfg, name))
                assert [k for k, _ in got] == [k for k, _ in expected[name]], (tp, pp, name)
                for (k, a), (_, b) in zip(got, expected[name]):
                    assert a.dtype == b.dtype and torch.equal(a, b), (tp, pp, name, k)
                if (tp, pp) == (2, 2) and name == "llama":
                    hf.export_hf(model, cfg, out / "hf_tp2pp2", "LlamaForCausalLM")
                    for g in (2, 1):
                        _check_generation(model, cfgs["llama"], refs, g, tol=FP32_LOGPROB_TOL)
        distributed.barrier()
    finally:
        distributed.destroy()


def _lora_case(cfg, weights: dict, ref: dict | None = None, where=(1, 1)) -> dict:
    """LoRA on the current layout (:mod:`aligner.models.lora`): the adapters' seeded
    initialisation, gathered, is the TP=1 one (replicated A equal on every rank); with the same
    full adapters loaded (B away from zero), the gathered logits (Megatron's forward and the
    fused one) and adapter gradients equal ``ref``'s (TP=1's) to fp32 round-off, and so does the
    merged weight stream. PP > 1: the stream only (its forward is the pipeline schedule's).
    Returns this layout's results."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from aligner.models import forward, lora, lora_io
    from aligner.models.layout import iter_megatron_tensors

    lcfg = lora.LoraConfig(rank=4, alpha=8.0)
    model = _policy(cfg, weights)
    lora.apply_lora(model, lcfg, seed=3)
    out = {"init": {k: v.clone() for k, v in lora_io.iter_lora_tensors(model)}}
    g = torch.Generator().manual_seed(17)
    full = {s.name: 0.1 * torch.randn(s.shape, generator=g) for s in lora_io.lora_tensor_specs(cfg, lcfg)}
    lora_io.load_lora_tensors(model, full.__getitem__)
    out["stream"] = {k: v.clone() for k, v in iter_megatron_tensors(model, cfg)}
    tp = mpu.get_tensor_model_parallel_world_size()
    if where[1] == 1:
        tokens = torch.tensor(TOKENS)
        for mode in ("megatron", "fused"):
            forward.set_forward(model, mode, tp)
            model.zero_grad(set_to_none=True)
            logits = forward.policy_logits(model, tokens)  # this rank's vocabulary shard
            v = logits.shape[-1]
            col = torch.arange(v) + mpu.get_tensor_model_parallel_rank() * v  # global vocabulary ids
            w = (
                torch.linspace(0.5, 1.5, tokens.numel()).view(*tokens.shape, 1)
                * (col < cfg.vocab_size)
                * (1 + col / 100)
            )
            (logits * w).sum().backward()  # each rank's share of one loss over the real vocabulary
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.detach().contiguous(), group=mpu.get_tensor_model_parallel_group())
            grads = {n: p.grad for n, p in lora.lora_parameters(model).items()}
            out[mode] = (
                torch.cat(parts, -1)[..., : cfg.vocab_size],
                {k: t.clone() for k, t in lora_io.iter_lora_tensors(model, values=grads)},
            )
    if ref is None:
        return out
    for name, t in out["init"].items():
        assert torch.equal(t, ref["init"][name]), (where, "initial adapter", name)
    assert out["stream"].keys() == ref["stream"].keys()
    for name, t in out["stream"].items():
        torch.testing.assert_close(
            t, ref["stream"][name], atol=1e-6, rtol=0, msg=lambda m, name=name: f"{where} {name}: {m}"
        )
    for mode in ("megatron", "fused") if where[1] == 1 else ():
        logits, grads = out[mode]
        torch.testing.assert_close(logits, ref["megatron"][0], atol=1e-5, rtol=0)
        for name, want in ref["megatron"][1].items():
            err = float((grads[name] - want).norm() / want.norm())
            assert err < 1e-5, (where, mode, name, err)
    return out


# ----------------------------------------------------------------------------------------------
# Generation in its own layout (two processes)
# ----------------------------------------------------------------------------------------------


def generation_cfg():
    """GQA (4 heads, 2 groups: one per rank at TP=2), SwiGLU (fc1 is [gate; up]), untied head,
    vocabulary 14 padded to 16 (at TP=2 the second shard reaches into the padding)."""
    from aligner.models.config import ModelConfig

    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=14,
        max_seq_len=48,
        make_vocab_size_divisible_by=8,
    )


def qk_norm_cfg():
    """Qwen3-style: heads 32 wide (not 64 / 4) with per-head q/k norms (replicated, one head
    wide, in the stream), two groups (one per rank at generation TP=2), llama3-scaled RoPE for
    an original context of 8 (generation runs past it)."""
    import dataclasses

    return dataclasses.replace(
        generation_cfg(),
        kv_channels=32,
        qk_layernorm=True,
        rope_scaling="llama3",
        rope_original_max_position=8,
    )


def _greedy():
    from aligner.generation import SamplingParams

    return SamplingParams(max_new_tokens=16, greedy=True)


def _engine(model, ps, **kw):
    from aligner.generation import NativeEngine

    return NativeEngine(model, pad_id=0, eos_id=1, max_seq_len=48, parallel_state=ps, **kw)


def _references(cfg, old: dict, new: dict | None = None) -> dict:
    """Greedy outputs of TP=1 zero-copy engines on the current layout (TP=1, any DP): fp32 on
    ``old`` and ``new`` weights, bf16 on ``old`` rounded to bf16."""
    import torch

    ps = _layout(1, 1)
    refs = {}
    for key, weights, dtype in (("old", old, None), ("new", new, None), ("old_bf16", old, torch.bfloat16)):
        if weights is None:
            continue
        engine = _engine(_policy(cfg, weights, dtype), ps)
        assert not engine.owns_weights
        refs[key] = engine.generate(PROMPTS, _greedy())
    return refs


def _same(out, ref, tol: float, what) -> bool:
    """Greedy tokens equal and log-probs within ``tol`` (assertions name ``what``)."""
    import torch

    if not torch.equal(out.tokens, ref.tokens):
        return False
    assert torch.equal(out.lengths, ref.lengths) and torch.equal(out.ended, ref.ended), what
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=tol, rtol=0, msg=lambda m: f"{what}: {m}")
    return True


def _check_generation(model, cfg, refs: dict, g: int, tol: float, ps=None):
    """An owned engine at generation TP ``g`` on ``model`` (current layout) equals the TP=1
    reference, and every rank of the world returns the same tokens, greedy and sampled."""
    import torch
    import torch.distributed as dist

    from aligner.generation import SamplingParams

    engine = _engine(model, ps, generation_tp=g)
    assert engine.owns_weights and engine.layout.size == g
    out = engine.generate(PROMPTS, _greedy())
    assert _same(out, refs["old"], tol, f"generation TP {g}"), (out.tokens, refs["old"].tokens)
    assert _all_same(out.tokens) and _all_same(out.logprobs)
    torch.manual_seed(1000 + dist.get_rank())  # desynchronised: the replica's first rank's draw wins
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, top_k=5))
    assert _all_same(sampled.tokens, engine.layout.replica_group), (
        f"generation TP {g}: a replica sampled apart"
    )
    return engine


def generation_worker(rank: int, world: int, port: int) -> None:
    """Train at PP=2 / generate at TP=1, train at TP=2 / generate at TP=1, train at TP=1 x PP=2 /
    generate at TP=2 (there also a model with q/k norms, :func:`qk_norm_cfg`): greedy tokens
    equal the TP=1 zero-copy engine's on the same weights and log-probs agree to
    ``FP32_LOGPROB_TOL``; a bf16 engine from the fp32 PP=2 policy equals the
    TP=1 bf16 zero-copy engine exactly. After a policy update, the engine (not yet refitted)
    still generates the old weights' tokens, which differ from the new weights' reference, so a
    refit that moved nothing fails; after the refit it generates the new reference's tokens."""
    _init(rank, world, port)
    import torch

    from aligner import distributed
    from aligner.models.layout import ParallelLayout, megatron_tensor_specs

    cfg = generation_cfg()
    old = random_weights(cfg, seed=5)
    new = {
        k: v + 0.15 * torch.randn(v.shape, generator=torch.Generator().manual_seed(99))
        for k, v in old.items()
    }
    qk_cfg = qk_norm_cfg()
    qk_weights = random_weights(qk_cfg, seed=8)
    try:
        refs = _references(cfg, old, new)
        assert not torch.equal(refs["old"].tokens, refs["new"].tokens)  # the update changes the tokens
        qk_refs = _references(qk_cfg, qk_weights)
        for tp, pp, g in ((1, 2, 1), (2, 1, 1), (1, 2, 2)):
            what = f"train TP {tp} x PP {pp}, generate TP {g}"
            ps = _layout(tp, pp)
            model = _policy(cfg, old)
            engine = _check_generation(model, cfg, refs, g, FP32_LOGPROB_TOL, ps)
            if g == 2:  # q/k norms replicated and 32-wide heads cut by group in the owned layout
                _check_generation(_policy(qk_cfg, qk_weights), qk_cfg, qk_refs, g, FP32_LOGPROB_TOL, ps)
            lay = ParallelLayout(tp=g, tp_rank=engine.layout.rank)
            shard_bytes = sum(
                4 * torch.Size(lay.shard_shape(s, cfg)).numel() for s in megatron_tensor_specs(cfg)
            )
            assert engine.last_refit.owned and engine.last_refit.bytes == shard_bytes, (
                what,
                engine.last_refit,
            )

            # A policy update in place (every rank's shards of the new weights).
            from aligner.models.layout import load_megatron_tensors

            load_megatron_tensors(model, cfg, new.__getitem__)
            stale = engine.generate(PROMPTS, _greedy())
            assert _same(stale, refs["old"], FP32_LOGPROB_TOL, what), (
                f"{what}: the engine saw weights before a refit"
            )
            assert not _same(stale, refs["new"], FP32_LOGPROB_TOL, what), (
                f"{what}: skipping the refit went unseen"
            )
            engine.refit(model)
            fresh = engine.generate(PROMPTS, _greedy())
            assert _same(fresh, refs["new"], FP32_LOGPROB_TOL, what), (
                f"{what}: the refit did not move the weights"
            )
            assert engine.last_refit.bytes == shard_bytes and engine.last_refit.seconds > 0

            if (tp, pp, g) == (1, 2, 1):
                # bf16 generation from fp32 training: the same bf16 weights and arithmetic as a
                # bf16 policy at TP=1, so the same tokens and bit-equal log-probs.
                load_megatron_tensors(model, cfg, old.__getitem__)
                bf16 = _engine(model, ps, generation_tp=1, dtype="bf16")
                assert bf16.owns_weights and bf16.last_refit.bytes == shard_bytes // 2
                got = bf16.generate(PROMPTS, _greedy())
                assert _same(got, refs["old_bf16"], 0.0, f"{what}, bf16"), (
                    got.tokens,
                    refs["old_bf16"].tokens,
                )
        distributed.barrier()
    finally:
        distributed.destroy()

"""Worker processes for tests/models/test_hf_convert_tp.py (spawned, so they live in an importable module).

Each worker joins a 2-process gloo world, imports an HF folder at TP=2 or PP=2, computes what
the test compares, exports, saves our checkpoint, and writes results under ``out_dir``
(safetensors, no pickles). Rank 0 writes the tensors the test reads.
"""

from __future__ import annotations

import os
from pathlib import Path


def _setup(rank: int, world_size: int, port: int, tp: int, pp: int):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    import torch

    torch.set_num_threads(1)
    from aligner import distributed

    return distributed.initialize(
        distributed.ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, backend="gloo", timeout_s=120.0
        ),
        seed=1234,
    )


def tp_worker(
    rank: int,
    world_size: int,
    port: int,
    hf_dir: str,
    rm_dir: str,
    out_dir: str,
    tokens: list[list[int]],
    more: dict[str, str] | None = None,
) -> None:
    """TP=2: policy logits (vocab-parallel, gathered), export, checkpoint; reward-model scores.
    ``more``: name -> HF folder of further policies or sequence classifiers (their role from
    the folder's architecture), each run through Megatron's forward and the fused one and
    exported (``out_dir/<name>``), their outputs saved as ``<name>.megatron``/``<name>.fused``."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from aligner import distributed
    from aligner.models import checkpoint_io, forward, hf, hf_config

    state = _setup(rank, world_size, port, tp=2, pp=1)
    out = Path(out_dir)
    try:
        tok = torch.tensor(tokens)
        model, cfg = hf.import_hf(hf_dir, make_vocab_size_divisible_by=8)
        model.eval()
        with torch.no_grad():
            local = forward.policy_logits(model, tok)  # [b, s, padded_vocab / 2]
        assert local.shape[-1] == cfg.padded_vocab_size(2) // 2, local.shape
        parts = [torch.empty_like(local) for _ in range(state.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=state.tp_group)
        full = torch.cat(parts, dim=-1)
        hf.export_hf(model, cfg, out / "hf_tp2", "LlamaForCausalLM")
        checkpoint_io.save_model_checkpoint(model, cfg, out / "ckpt_tp2", "policy")

        rm, rm_cfg = hf.import_hf(rm_dir, "reward")
        rm.eval()
        lengths = torch.tensor([len(t) for t in tokens])
        with torch.no_grad():
            scores = forward.sequence_scores(rm, tok, lengths)
        hf.export_hf(rm, rm_cfg, out / "rm_tp2", "llama", hf_config=rm_dir)
        results = {"logits": full.contiguous(), "scores": scores.contiguous()}
        for name, folder in (more or {}).items():
            arch = hf_config.hf_architecture(folder)
            role = "policy" if hf_config.resolve_architecture(arch)[1] == "lm" else "reward"
            m, m_cfg = hf.import_hf(folder, role, make_vocab_size_divisible_by=8)
            m.eval()
            for mode in ("megatron", "fused"):
                assert forward.set_forward(m, mode, tensor_parallel_size=2) == (mode, None), (name, mode)
                with torch.no_grad():
                    if role == "reward":
                        got = forward.sequence_scores(m, tok, lengths)
                    else:
                        got = forward.policy_logits(m, tok)
                        parts = [torch.empty_like(got) for _ in range(state.tp_size)]
                        dist.all_gather(parts, got.contiguous(), group=state.tp_group)
                        got = torch.cat(parts, dim=-1)[..., : m_cfg.vocab_size]
                results[f"{name}.{mode}"] = got.contiguous()
                if role == "policy" and m_cfg.qk_layernorm:
                    results.update(_qk_norm_grads(m, m_cfg, tok, state, f"{name}.{mode}"))
            hf.export_hf(m, m_cfg, out / name, arch, hf_config=folder)
        if rank == 0:
            save_file(results, str(out / "tp_results.safetensors"))
        dist.barrier()
    finally:
        distributed.destroy()


def qk_norm_loss_weights(b: int, s: int, vocab: int):
    """The weights of the test loss ``sum(logits * w)``, one per logit of the real vocabulary."""
    import torch

    return torch.linspace(0.5, 1.5, b * s * vocab).view(b, s, vocab)


def _qk_norm_grads(model, cfg, tok, state, prefix: str) -> dict:
    """The gradients of the q/k norm weights (under their HF names) of the loss
    ``sum(logits * w)`` at TP=2, after checking every TP rank holds the same (the whole model's,
    not its own heads' share)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    b, s = tok.shape
    w = qk_norm_loss_weights(b, s, cfg.vocab_size)
    w = F.pad(w, (0, cfg.padded_vocab_size(state.tp_size) - cfg.vocab_size))
    w = w.chunk(state.tp_size, dim=-1)[dist.get_rank(state.tp_group)]
    model.zero_grad(set_to_none=True)
    from aligner.models import forward

    (forward.policy_logits(model, tok) * w).sum().backward()
    out = {}
    for name, p in model.named_parameters():
        if "_layernorm." in name and ("q_layernorm" in name or "k_layernorm" in name):
            parts = [torch.empty_like(p.grad) for _ in range(state.tp_size)]
            dist.all_gather(parts, p.grad.contiguous(), group=state.tp_group)
            assert all(torch.equal(parts[0], x) for x in parts), f"{prefix}: {name} differs across TP"
            layer = name.split(".")[2]
            which = "q_norm" if "q_layernorm" in name else "k_norm"
            out[f"{prefix}.grad.model.layers.{layer}.self_attn.{which}.weight"] = p.grad.clone()
    assert out, "no q/k norm parameters"
    model.zero_grad(set_to_none=True)
    return out


def pp_worker(
    rank: int, world_size: int, port: int, hf_dir: str, out_dir: str, tokens: list[list[int]]
) -> None:
    """PP=2: a hand-run two-stage forward (stage 0 sends its hidden states to stage 1), export,
    checkpoint."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from aligner import distributed
    from aligner.models import checkpoint_io, forward, gpt, hf

    state = _setup(rank, world_size, port, tp=1, pp=2)
    out = Path(out_dir)
    try:
        tok = torch.tensor(tokens)
        model, cfg = hf.import_hf(hf_dir)
        model.eval()
        layers = len(model.decoder.layers)
        assert layers == cfg.num_layers // 2, layers
        b, s = tok.shape
        with torch.no_grad():
            if state.is_first_stage:
                hidden = model(tok, gpt.position_ids_for(tok), attention_mask=None)  # [s, b, h]
                dist.send(hidden.contiguous(), dst=dist.get_global_rank(state.pp_group, 1))
            else:
                hidden = torch.empty(s, b, cfg.hidden_size)
                dist.recv(hidden, src=dist.get_global_rank(state.pp_group, 0))
                model.set_input_tensor(hidden)
                logits = forward.policy_logits(model, tok)
        hf.export_hf(model, cfg, out / "hf_pp2", "LlamaForCausalLM")
        checkpoint_io.save_model_checkpoint(model, cfg, out / "ckpt_pp2", "policy")
        if state.is_last_stage:
            save_file({"logits": logits.contiguous()}, str(out / "pp_results.safetensors"))
        dist.barrier()
    finally:
        distributed.destroy()

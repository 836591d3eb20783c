"""HF conversion under tensor and pipeline parallelism (two gloo processes on the CPU).

Every comparison is against transformers itself, or against the same model converted at
TP=1, so a wrong shard, a wrong gather or a wrong layer offset shows up as a logit difference.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from _hf_workers import pp_worker, qk_norm_loss_weights, tp_worker
from safetensors import safe_open
from safetensors.torch import load_file

from aligner import distributed
from aligner.models import checkpoint_io, forward, hf

pytestmark = pytest.mark.multiprocess
VOCAB = 100
TOL = 1e-4


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    transformers.logging.set_verbosity_error()


def _randomize(model: torch.nn.Module) -> None:
    """Norm weights and biases away from 1/0, so a misplaced one changes the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))


def _llama(tmp_path, name, cls="LlamaForCausalLM", layers=2, **kw):
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attn_implementation="eager",
        **kw,
    )
    model = getattr(transformers, cls)(config).eval()
    _randomize(model)
    path = tmp_path / name
    model.save_pretrained(path)
    return model, str(path)


def _tokens(b=2, s=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (b, s), generator=g)


def _spawn(fn, *args):
    port = distributed.free_port()
    # join=True: a worker that raises fails the test (the other one is terminated).
    mp.spawn(fn, args=(2, port, *args), nprocs=2, join=True)


def _reload_logits(folder, tokens, cls="LlamaForCausalLM"):
    m = getattr(transformers, cls).from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return m(tokens).logits


def _qwen3(tmp_path, name, cls="Qwen3ForCausalLM", **kw):
    """Qwen3 with heads 32 wide (not 64 / 4), q/k norms, two query groups (one per rank at
    TP=2) and Llama 3.1's RoPE scaling with an original context of 8 (the tokens run past it)."""
    torch.manual_seed(11)
    config = transformers.Qwen3Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8,
        ),
        attn_implementation="eager",
        **kw,
    )
    model = getattr(transformers, cls)(config).eval()
    _randomize(model)
    path = tmp_path / name
    model.save_pretrained(path)
    return model, str(path)


def test_tp2_import_export_and_checkpoint(tmp_path):
    ref_model, hf_dir = _llama(tmp_path, "llama")
    rm_ref, rm_dir = _llama(
        tmp_path, "llama_rm", cls="LlamaForSequenceClassification", num_labels=1, pad_token_id=0
    )
    qwen3, qwen3_dir = _qwen3(tmp_path, "qwen3")
    qwen3_rm, qwen3_rm_dir = _qwen3(
        tmp_path, "qwen3_rm", cls="Qwen3ForSequenceClassification", num_labels=1, pad_token_id=0
    )
    tokens = _tokens()
    out = tmp_path / "out"
    out.mkdir()
    more = {"qwen3": qwen3_dir, "qwen3_rm": qwen3_rm_dir}
    _spawn(tp_worker, hf_dir, rm_dir, str(out), tokens.tolist(), more)

    with torch.no_grad():
        ref = ref_model(tokens).logits
        ref_scores = rm_ref(tokens).logits[:, 0]
    res = load_file(str(out / "tp_results.safetensors"))
    # Vocab-parallel logits gathered along the last dim; padded columns trimmed.
    assert res["logits"].shape[-1] == 112
    assert (res["logits"][..., :VOCAB] - ref).abs().max().item() < TOL
    assert (res["scores"] - ref_scores).abs().max().item() < TOL

    # Exported at TP=2: transformers reads it and computes the same logits.
    with safe_open(str(out / "hf_tp2" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [VOCAB, 64]
    assert (_reload_logits(out / "hf_tp2", tokens) - ref).abs().max().item() < TOL
    rm_scores = _reload_logits(out / "rm_tp2", tokens, "LlamaForSequenceClassification")[:, 0]
    assert (rm_scores - ref_scores).abs().max().item() < TOL

    # Qwen3 (q/k norms replicated, 32-wide heads sharded by group, llama3 RoPE) at TP=2: both
    # forwards match transformers, and the TP=2 export holds exactly transformers' tensors.
    for name, ref_m in (("qwen3", qwen3), ("qwen3_rm", qwen3_rm)):
        with torch.no_grad():
            want = ref_m(tokens).logits
        want = want if name == "qwen3" else want[:, 0]
        for mode in ("megatron", "fused"):
            assert (res[f"{name}.{mode}"] - want).abs().max().item() < TOL, (name, mode)
        if name == "qwen3":
            # The q/k norms' gradients of one loss: each TP rank holds the whole model's (its own
            # heads' share summed with the other rank's), equal to transformers'.
            qwen3.zero_grad(set_to_none=True)
            (qwen3(tokens).logits * qk_norm_loss_weights(*tokens.shape, VOCAB)).sum().backward()
            want_grads = {
                k: p.grad for k, p in qwen3.named_parameters() if "_norm." in k and ".self_attn." in k
            }
            assert len(want_grads) == 4
            for mode in ("megatron", "fused"):
                for k, g in want_grads.items():
                    got = res[f"qwen3.{mode}.grad.{k}"]
                    err = float((got - g).norm() / g.norm())
                    assert err < 1e-4, (mode, k, err)
        original = load_file(os.path.join(tmp_path, name, "model.safetensors"))
        exported = load_file(str(out / name / "model.safetensors"))
        assert exported.keys() == original.keys(), name
        for k in original:
            assert torch.equal(exported[k], original[k]), (name, k)

    # Our checkpoint saved at TP=2 loads at TP=1 with the same logits, and holds exactly the
    # tensors a TP=1 save of the same HF model holds.
    distributed.initialize(distributed.ParallelConfig())
    try:
        model, cfg, meta = checkpoint_io.build_from_checkpoint(out / "ckpt_tp2")
        assert meta["role"] == "policy" and cfg.make_vocab_size_divisible_by == 8
        model.eval()
        with torch.no_grad():
            ours = forward.policy_logits(model, tokens)[..., :VOCAB]
        assert (ours - ref).abs().max().item() < TOL
        tp1, cfg1 = hf.import_hf(hf_dir, make_vocab_size_divisible_by=8)
        checkpoint_io.save_model_checkpoint(tp1, cfg1, tmp_path / "ckpt_tp1")
    finally:
        distributed.destroy()
    a = load_file(str(out / "ckpt_tp2" / "model.safetensors"))
    b = load_file(str(tmp_path / "ckpt_tp1" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_pp2_import_export_and_checkpoint(tmp_path):
    ref_model, hf_dir = _llama(tmp_path, "llama4", layers=4)
    tokens = _tokens()
    out = tmp_path / "out"
    out.mkdir()
    _spawn(pp_worker, hf_dir, str(out), tokens.tolist())

    with torch.no_grad():
        ref = ref_model(tokens).logits
    res = load_file(str(out / "pp_results.safetensors"))
    assert (res["logits"] - ref).abs().max().item() < TOL
    assert (_reload_logits(out / "hf_pp2", tokens) - ref).abs().max().item() < TOL
    hf_ref = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(str(out / "hf_pp2" / "model.safetensors"))
    assert exported.keys() == hf_ref.keys()
    for k in hf_ref:
        assert torch.equal(exported[k], hf_ref[k]), k

    distributed.initialize(distributed.ParallelConfig())
    try:
        model, _, _ = checkpoint_io.build_from_checkpoint(out / "ckpt_pp2")
        model.eval()
        with torch.no_grad():
            ours = forward.policy_logits(model, tokens)
        assert (ours - ref).abs().max().item() < TOL
    finally:
        distributed.destroy()

"""LoRA on the policy (``aligner.models.lora``): the adapters' arithmetic against a naive merged
model, the fused forward against Megatron's, what trains, the merged weight stream, the HF and
peft exports against transformers, the adapter-only checkpoints, ``trainable_last_n_layers``,
the generation engine's merged weights, and a LoRA policy learning the copy task through a real
server. TP=2 against TP=1 (forward, adapter gradients, merged stream) is a case of the weight
stream's four-process worker (``tests/_layout_workers.py``).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _actor_parts import tiny_run_config

from aligner import distributed
from aligner.models import forward, gpt, lora, lora_io
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.layout import iter_megatron_tensors

ARCHS = {
    # Llama-style: RMSNorm, SwiGLU (fc1 = [gate; up]), RoPE, grouped-query attention, untied head.
    "llama": dict(num_query_groups=2),
    # GPT-2-style: LayerNorm, GELU, learned positions, biases on every linear, tied embeddings.
    "gpt2": dict(
        normalization="LayerNorm",
        activation="gelu_tanh",
        position_embedding="learned_absolute",
        add_bias_linear=True,
        tie_embeddings=True,
    ),
}
TOKENS = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(0))


def _cfg(arch: str) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=40,
        max_seq_len=32,
        init_method_std=0.1,
        **ARCHS[arch],
    )


@pytest.fixture(autouse=True)
def _world():
    # Idempotent; the learning test's entry point tears its process group down at the end.
    torch.set_num_threads(1)
    distributed.initialize()
    yield


def _base(arch: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    return gpt.build_policy(_cfg(arch), params_dtype=dtype)


def _random_b(model, seed: int = 3, std: float = 0.05) -> None:
    """Move every lora_B away from zero (as training would), reproducibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora.lora_parameters(model).items():
            if name.endswith("lora_B"):
                p.copy_(std * torch.randn(p.shape, generator=g))


def _lora_model(arch: str, rank: int = 4, alpha: float = 8.0, seed: int = 1, dtype=torch.float32):
    model = _base(arch, dtype)
    lora.apply_lora(model, lora.LoraConfig(rank=rank, alpha=alpha), seed=seed)
    _random_b(model)
    return model


def _by_hand(model) -> dict[str, torch.Tensor]:
    """Every adapted weight merged by hand, W + (alpha / r) * B @ A, in fp32."""
    scale = lora.lora_config_of(model).scale
    return {
        f"{name}.weight": (mod.weight.float() + scale * (mod.lora_B.float() @ mod.lora_A.float())).detach()
        for name, mod in lora.lora_modules(model)
    }


def _merged_model(model, arch: str):
    """A plain model (no adapters) holding ``model``'s weights with the adapters merged by hand."""
    plain = _base(arch)
    state = gpt.tensor_state_dict(model)
    state.update(_by_hand(model))
    gpt.load_state_dict_strict(plain, state, what="merged model")
    return plain


def _loss(out: torch.Tensor) -> torch.Tensor:
    # Every output element weighted differently, so every gradient path is used.
    return (out * torch.linspace(0.5, 1.5, out.numel()).view_as(out)).sum()


# ------------------------------------------------------------------------------------------------
# Config and set-up
# ------------------------------------------------------------------------------------------------


def test_config_problems_name_the_key_the_value_and_what_was_expected():
    from aligner.actor.config import ActorConfig

    assert lora.LoraConfig().problems() == [] and not lora.LoraConfig().enabled
    bad = lora.LoraConfig(rank=4, alpha=0, dropout=1.0, targets=["linear_qkv", "q_proj"])
    got = "\n".join(bad.problems())
    for fragment in (
        "lora.alpha=0",
        "lora.dropout=1.0: expected a value in [0, 1)",
        "lora.targets=",
        "q_proj",
    ):
        assert fragment in got, got
    assert "lora.rank=-1: expected an integer >= 0" in "\n".join(lora.LoraConfig(rank=-1).problems())
    assert lora.LoraConfig(rank=8, alpha=32).scale == 4.0
    cfg = ActorConfig()
    cfg.lora.rank, cfg.lora.dropout, cfg.model_forward = 4, 0.1, "fused"
    got = "\n".join(cfg.problems())
    assert "model_forward='fused': the fused forward has no LoRA dropout (lora.dropout=0.1)" in got, got
    cfg.model_forward = "auto"
    assert not [p for p in cfg.problems() if "lora" in p]


def test_apply_lora_freezes_the_base_and_initialises_the_adapters_as_peft():
    model = _base("llama")
    names = lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8), seed=1)
    assert names == [
        f"decoder.layers.{i}.{p}"
        for i in range(2)
        for p in (
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            "mlp.linear_fc1",
            "mlp.linear_fc2",
        )
    ]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora.lora_parameters(model)) and len(trainable) == 16
    for name, mod in lora.lora_modules(model):
        out_f, in_f = mod.weight.shape
        assert mod.lora_A.shape == (4, in_f) and mod.lora_B.shape == (out_f, 4)
        assert torch.count_nonzero(mod.lora_B) == 0
        bound = 1 / math.sqrt(in_f)  # peft: kaiming_uniform_(a=sqrt(5)) -> U(-1/sqrt(in), 1/sqrt(in))
        a = mod.lora_A.detach()
        assert float(a.abs().max()) <= bound and float(a.abs().max()) > 0.8 * bound
        # Megatron's marks: a column-parallel linear's B and a row-parallel one's A are split.
        column = name.endswith(("linear_qkv", "linear_fc1"))
        assert mod.lora_B.tensor_model_parallel is column and mod.lora_A.tensor_model_parallel is not column
    # Seeded: the same seed draws the same A, another seed another.
    again = _base("llama")
    lora.apply_lora(again, lora.LoraConfig(rank=4, alpha=8), seed=1)
    other = _base("llama")
    lora.apply_lora(other, lora.LoraConfig(rank=4, alpha=8), seed=2)
    for name, p in lora.lora_parameters(model).items():
        assert torch.equal(p, lora.lora_parameters(again)[name])
        if name.endswith("lora_A"):
            assert not torch.equal(p, lora.lora_parameters(other)[name])
    with pytest.raises(ConversionError, match="already has LoRA adapters"):
        lora.apply_lora(model, lora.LoraConfig(rank=4))
    with pytest.raises(ConversionError, match="lora.rank=0: LoRA is off"):
        lora.apply_lora(_base("llama"), lora.LoraConfig())
    with pytest.raises(ConversionError, match="lora.targets="):
        lora.apply_lora(_base("llama"), lora.LoraConfig(rank=2, targets=["output_layer"]))
    fused = _base("llama")
    forward.set_forward(fused, "fused")
    with pytest.raises(ConversionError, match="apply LoRA before aligner.models.forward.set_forward"):
        lora.apply_lora(fused, lora.LoraConfig(rank=2))


# ------------------------------------------------------------------------------------------------
# The arithmetic
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_zero_b_gives_the_base_logits_exactly(arch):
    model = _base(arch)
    base = {}
    for mode in ("megatron", "fused"):
        forward.set_forward(model, mode)
        with torch.no_grad():
            base[mode] = forward.policy_logits(model, TOKENS)
    forward.set_forward(model, "megatron")  # LoRA goes on before a fused forward is set up
    lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8), seed=1)
    for mode in ("megatron", "fused"):
        assert forward.set_forward(model, mode) == (mode, None)
        with torch.no_grad():
            assert torch.equal(forward.policy_logits(model, TOKENS), base[mode]), mode


@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_and_gradients_equal_the_merged_model(arch):
    """The adapted model's logits are the merged model's (W + s B A, merged by hand), and its
    adapters' gradients are the chain rule through the merge: dA = s B^T dW, dB = s dW A^T.
    The fused forward's logits and gradients are Megatron's to round-off (its attention is
    SDPA: tests/models/test_fused_forward.py)."""
    model = _lora_model(arch)
    merged = _merged_model(model, arch)
    got = {}
    for mode in ("megatron", "fused"):
        forward.set_forward(model, mode)
        model.zero_grad(set_to_none=True)
        out = forward.policy_logits(model, TOKENS)
        _loss(out).backward()
        got[mode] = (
            out.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
    torch.testing.assert_close(got["fused"][0], got["megatron"][0], atol=1e-5, rtol=0)
    out = forward.policy_logits(merged, TOKENS)
    _loss(out).backward()
    torch.testing.assert_close(got["megatron"][0], out.detach(), atol=1e-5, rtol=0)
    scale = lora.lora_config_of(model).scale
    for mode, (_, grads) in got.items():
        assert set(grads) == set(lora.lora_parameters(model)), mode  # the base has no gradient
        for name, mod in lora.lora_modules(model):
            dw = merged.get_submodule(name).weight.grad
            want = {
                f"{name}.lora_A": scale * mod.lora_B.detach().T @ dw,
                f"{name}.lora_B": scale * dw @ mod.lora_A.detach().T,
            }
            for key, w in want.items():
                err = float((grads[key] - w).norm() / w.norm())
                assert err < 1e-5, (mode, key, err)


def test_dropout_runs_on_the_adapters_in_training_only_and_megatron_forward_takes_it():
    model = _base("llama")
    lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8, dropout=0.5), seed=1)
    _random_b(model)
    assert forward.set_forward(model, "auto") == ("megatron", "LoRA dropout (lora.dropout=0.5)")
    with pytest.raises(ValueError, match="LoRA dropout"):
        forward.set_forward(model, "fused")
    merged = _merged_model(model, "llama")
    with torch.no_grad():
        model.eval()
        torch.testing.assert_close(
            forward.policy_logits(model, TOKENS), forward.policy_logits(merged, TOKENS), atol=1e-5, rtol=0
        )
        model.train()
        assert not torch.allclose(
            forward.policy_logits(model, TOKENS), forward.policy_logits(merged, TOKENS), atol=1e-3
        )


# ------------------------------------------------------------------------------------------------
# Training: what the optimizer holds and changes; the merged stream
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_optimizer_steps_change_only_the_adapters_and_the_stream_carries_them_merged(precision):
    from aligner.actor.config import ActorConfig
    from aligner.actor.optimizer import freeze_all_but_last_layers, make_policy_optimizer

    cfg = ActorConfig()
    cfg.lora.rank, cfg.lora.alpha = 4, 8.0
    cfg.optim.lr = cfg.optim.min_lr = 1e-2
    cfg.optim.warmup_steps = 0
    model = _base("llama")
    lora.apply_lora(model, cfg.lora, seed=1)
    freeze_all_but_last_layers(model, cfg.optim.trainable_last_n_layers, 2)
    opt, _ = make_policy_optimizer(model, cfg, precision)
    adapters = lora.lora_parameters(model)
    assert {id(p) for p in opt.model_params} == {id(p) for p in adapters.values()}
    assert all(m.dtype == torch.float32 for m in opt.master_params) and len(opt.master_params) == 16
    assert opt.precision == precision
    before = {k: v.clone() for k, v in gpt.tensor_state_dict(model).items()}  # after the bf16 cast
    adapters_before = {k: p.detach().clone() for k, p in adapters.items()}
    target = torch.randint(0, 40, TOKENS.shape, generator=torch.Generator().manual_seed(5))
    forward.set_forward(model, "fused")
    for _ in range(3):
        opt.zero_grad()
        logits = forward.policy_logits(model, TOKENS)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
        opt.clip_grad_norm(1.0)
        assert opt.step()
    after = gpt.tensor_state_dict(model)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), f"base weight {k} changed"
    for k, p in adapters.items():
        assert not torch.equal(p, adapters_before[k]), f"adapter {k} did not train"
    stream = dict(iter_megatron_tensors(model))
    assert not any(lora.is_lora_name(k) for k in stream) and stream.keys() == before.keys()
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    for name, merged in _by_hand(model).items():
        assert torch.equal(stream[name], merged.to(dtype)), name
    for name in set(stream) - set(_by_hand(model)):
        assert torch.equal(stream[name], before[name]), name


def _grad_names(model) -> set[str]:
    forward.set_forward(model, "fused")
    model.zero_grad(set_to_none=True)
    _loss(forward.policy_logits(model, TOKENS)).backward()
    return {n for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_trainable_last_n_layers_trains_exactly_what_it_says(tied):
    """Which parameters receive gradients: the last n layers, the final norm and an untied LM head
    (a tied one is frozen with the embedding); with LoRA, only the last n layers' adapters."""
    from aligner.actor.optimizer import freeze_all_but_last_layers

    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, vocab_size=40, tie_embeddings=tied)
    model = gpt.build_policy(cfg)
    everything = {n for n, _ in model.named_parameters()}
    freeze_all_but_last_layers(model, 1)
    want = {n for n in everything if n.startswith(("decoder.layers.2.", "decoder.final_layernorm."))}
    if not tied:
        want.add("output_layer.weight")
    assert _grad_names(model) == want
    freeze_all_but_last_layers(model, 3)  # every layer: all but the embedding (and a head tied to it)
    assert _grad_names(model) == everything - {"embedding.word_embeddings.weight"}

    forward.set_forward(model, "megatron")  # LoRA goes on before a fused forward is set up
    lora.apply_lora(model, lora.LoraConfig(rank=2), seed=0)
    assert _grad_names(model) == set(lora.lora_parameters(model))
    freeze_all_but_last_layers(model, 2)
    assert _grad_names(model) == {
        n for n in lora.lora_parameters(model) if not n.startswith("decoder.layers.0.")
    }


# ------------------------------------------------------------------------------------------------
# Exports: HF (merged) and peft (the adapters alone)
# ------------------------------------------------------------------------------------------------


def _peft_by_hand(hf_model, folder: Path) -> None:
    """Apply a peft LoRA folder to ``hf_model`` as peft's LoRA layers compute it: each adapted
    module's output plus lora_B(lora_A(x)) * lora_alpha / r."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    prefix = "base_model.model."
    modules = {k[len(prefix) : -len(".lora_A.weight")] for k in tensors if k.endswith(".lora_A.weight")}
    assert all(k.startswith(prefix) for k in tensors) and len(tensors) == 2 * len(modules)
    for name in modules:
        assert name.split(".")[-1] in {t.split(".")[-1] for t in config["target_modules"]}, name
        a, b = tensors[f"{prefix}{name}.lora_A.weight"], tensors[f"{prefix}{name}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == config["r"]

        def hook(module, args, out, a=a, b=b):
            return out + F.linear(F.linear(args[0], a), b) * scale

        hf_model.get_submodule(name).register_forward_hook(hook)


@pytest.mark.parametrize("arch,hf_arch", [("llama", "LlamaForCausalLM"), ("gpt2", "GPT2LMHeadModel")])
def test_hf_export_is_the_merged_model_and_the_peft_adapter_applies_to_the_base(tmp_path, arch, hf_arch):
    from transformers import AutoModelForCausalLM

    from aligner.models.hf import export_hf

    model = _base(arch)
    export_hf(model, None, tmp_path / "base", hf_arch)
    lora.apply_lora(model, lora.LoraConfig(rank=4, alpha=8), seed=1)
    _random_b(model)
    export_hf(model, None, tmp_path / "merged", hf_arch)
    lora_io.export_peft_adapter(model, tmp_path / "peft", hf_arch, base_model="base")
    forward.set_forward(model, "fused")
    with torch.no_grad():
        ours = forward.policy_logits(model, TOKENS)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
        torch.testing.assert_close(merged(TOKENS).logits, ours, atol=1e-5, rtol=0)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
        plain = base(TOKENS).logits
        assert (plain - ours).abs().max() > 1e-3  # the adapters change the model
        _peft_by_hand(base, tmp_path / "peft")
        torch.testing.assert_close(base(TOKENS).logits, ours, atol=1e-5, rtol=0)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == "base" and config["fan_in_fan_out"] is (arch == "gpt2")
    want = (
        ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        if arch == "llama"
        else ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    )
    assert config["target_modules"] == want


# ------------------------------------------------------------------------------------------------
# Adapter-only checkpoints
# ------------------------------------------------------------------------------------------------


def test_adapter_files_hold_only_the_adapters_and_round_trip(tmp_path):
    from safetensors.torch import load_file

    model = _lora_model("llama")
    lora_io.save_lora_adapter(model, tmp_path / "a", meta={"base_fingerprint": "abc"})
    saved = load_file(str(tmp_path / "a" / "adapter.safetensors"))
    assert set(saved) == set(lora.lora_parameters(model))  # TP=1, PP=1: full names = local names
    assert all(t.dtype == torch.float32 for t in saved.values())
    meta = json.loads((tmp_path / "a" / "adapter.json").read_text())
    assert meta["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": list(lora.TARGETS)}
    assert meta["base_fingerprint"] == "abc" and meta["format"] == lora_io.ADAPTER_FORMAT

    fresh = _base("llama")
    lora.apply_lora(fresh, lora.LoraConfig(rank=4, alpha=8), seed=7)  # another A, B = 0
    assert lora_io.load_lora_adapter(fresh, tmp_path / "a")["base_fingerprint"] == "abc"
    for name, p in lora.lora_parameters(model).items():
        assert torch.equal(lora.lora_parameters(fresh)[name], p), name
    forward.set_forward(fresh, "fused")
    forward.set_forward(model, "fused")
    with torch.no_grad():
        assert torch.equal(forward.policy_logits(fresh, TOKENS), forward.policy_logits(model, TOKENS))

    from aligner.checkpoint import CheckpointError

    other = _base("llama")
    lora.apply_lora(other, lora.LoraConfig(rank=2, alpha=8), seed=7)
    with pytest.raises(CheckpointError, match="lora.rank: adapter 4, model 2"):
        lora_io.load_lora_adapter(other, tmp_path / "a")


def test_actor_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path):
    """A LoRA run's actor checkpoint holds the adapters (no policy/ folder) with the base's
    fingerprint; resuming from its first checkpoint ends with the uninterrupted run's adapters,
    bit for bit, on an unchanged base; another base is refused."""
    from _toy_critic import TOK, ToyCritic

    from aligner.actor.checkpointing import LORA_DIR, ActorCheckpointer, weights_fingerprint
    from aligner.actor.config import ActorConfig, validate_actor_config
    from aligner.actor.prompts import PromptSampler
    from aligner.actor.trainer import PPOTrainer
    from aligner.checkpoint import CheckpointError, load_tensors, read_json, step_dir_name
    from aligner.generation.native import NativeEngine
    from aligner.metrics import MetricsLogger
    from aligner.tasks import get_task

    def config(root: Path, resume: str) -> ActorConfig:
        cfg = tiny_run_config()
        cfg.data.task, cfg.data.num_digits, cfg.generation.max_new_tokens = "copy", 3, 4
        p = cfg.ppo
        p.num_steps, p.global_batch_size, p.mini_batch_size, p.micro_batch_size = 4, 16, 8, 8
        cfg.lora.rank, cfg.lora.alpha = 4, 8.0
        cfg.optim.warmup_steps = 1
        cfg.precision = "bf16"  # the fp32 masters are what the checkpoint must carry
        cfg.checkpoint.dir, cfg.checkpoint.save_interval = str(root), 2
        cfg.checkpoint.keep_last, cfg.checkpoint.keep_best, cfg.checkpoint.resume = 0, False, resume
        cfg.validation.interval, cfg.validation.before_train = 0, False
        cfg.logging.run_dir, cfg.logging.tensorboard, cfg.logging.progress_bar = (
            str(root / "run"),
            False,
            False,
        )
        validate_actor_config(cfg, vocab_size=TOK.vocab_size)
        return cfg

    def trainer(
        cfg: ActorConfig, critic: ToyCritic, base_seed: int = 0
    ) -> tuple[PPOTrainer, ActorCheckpointer]:
        state = distributed.initialize(seed=cfg.seed)
        torch.manual_seed(base_seed)
        policy = gpt.build_policy(cfg.model)
        reference = gpt.build_policy(cfg.model)
        gpt.load_state_dict_strict(reference, gpt.tensor_state_dict(policy))
        reference.eval().requires_grad_(False)
        lora.apply_lora(policy, cfg.lora, seed=cfg.seed)
        ckpt = ActorCheckpointer(
            cfg, state, critic, TOK, reference_fingerprint=weights_fingerprint(reference, state)
        )
        engine = NativeEngine(policy, TOK, parallel_state=state, vocab_size=TOK.sample_vocab_size)
        assert engine.owns_weights  # LoRA: merged weights of its own
        sampler = PromptSampler(get_task("copy", 3).prompts(64, seed=cfg.seed), 16, 0, 1, cfg.seed)
        logger = MetricsLogger(cfg.logging.run_dir, tensorboard=False)
        return PPOTrainer(
            cfg, state, policy, reference, engine, critic, TOK, sampler, logger, checkpointer=ckpt
        ), ckpt

    critic = ToyCritic()
    full, _ = trainer(config(tmp_path, "none"), critic)
    full.train()
    final = {k: p.detach().clone() for k, p in lora.lora_parameters(full.policy).items()}
    assert all(torch.count_nonzero(v) for k, v in final.items() if k.endswith("lora_B"))  # they trained
    step2 = tmp_path / step_dir_name(2)
    assert not (step2 / "actor" / "policy").exists()
    saved = load_tensors(step2 / "actor" / LORA_DIR / "adapter.safetensors")
    assert set(saved) == set(final) and all(t.dtype == torch.float32 for t in saved.values())
    meta = read_json(step2 / "actor" / LORA_DIR / "adapter.json")
    assert meta["base_fingerprint"] == weights_fingerprint(full.policy, full.state)
    assert read_json(step2 / "actor" / "trainer_state.json")["lora"]["rank"] == 4

    resumed, ckpt = trainer(config(tmp_path, str(step2)), critic)
    resumed.load_training_state(ckpt.load(resumed.actor_state(), step2))
    resumed.train()
    for k, p in lora.lora_parameters(resumed.policy).items():
        assert torch.equal(p, final[k]), k

    other, ckpt = trainer(config(tmp_path, str(step2)), critic, base_seed=1)
    with pytest.raises(CheckpointError, match="LoRA base model: the frozen base weights differ"):
        ckpt.load(other.actor_state(), step2)
    changed = config(tmp_path, str(step2))
    changed.lora.rank = 2
    other, ckpt = trainer(changed, critic)
    with pytest.raises(CheckpointError, match="lora.rank: checkpoint 4, config 2"):
        ckpt.load(other.actor_state(), step2)


# ------------------------------------------------------------------------------------------------
# Generation: the engine owns merged weights and refits them
# ------------------------------------------------------------------------------------------------


def test_the_engine_generates_with_the_merged_weights_and_refits_them():
    from aligner.generation import NativeEngine, SamplingParams

    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    prompts = [[2, 3, 4], [5, 6, 7, 8, 9], [12]]
    model = _lora_model("llama")
    engine = NativeEngine(model, pad_id=0, eos_id=1)
    assert engine.owns_weights and engine.last_refit.owned

    def reference(m):
        plain = NativeEngine(_merged_model(m, "llama"), pad_id=0, eos_id=1)
        assert not plain.owns_weights
        return plain.generate(prompts, greedy)

    def same(out, ref) -> bool:
        torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
        return torch.equal(out.tokens, ref.tokens)

    assert same(engine.generate(prompts, greedy), reference(model))
    _random_b(model, seed=11, std=0.3)  # an update
    ref = reference(model)
    assert not torch.equal(engine.generate(prompts, greedy).tokens, ref.tokens)  # not refitted yet
    engine.refit(model)
    assert same(engine.generate(prompts, greedy), ref)
    with pytest.raises(ValueError, match="LoRA adapters"):
        NativeEngine(model, pad_id=0, eos_id=1, weights="shared")
    shared = NativeEngine(model, pad_id=0, eos_id=1, backend="megatron")  # Megatron's forward runs them
    assert not shared.owns_weights and same(shared.generate(prompts, greedy), ref)


# ------------------------------------------------------------------------------------------------
# Learning through a real server
# ------------------------------------------------------------------------------------------------


def _pretrain_base(out: Path) -> None:
    """A base policy for the learning run: the actor's default architecture, trained by
    supervision (150 steps, about 2 s) to answer a prompt with its digits reversed 4 times in 5
    and copied once in 5. Its copy reward is then about 0.45; PPO must make copying the rule."""
    from aligner.actor.config import ActorConfig
    from aligner.models.checkpoint_io import save_model_checkpoint
    from aligner.tasks import get_task
    from aligner.tokenizers import CharTokenizer

    cfg = ActorConfig().model
    cfg.max_seq_len = 16
    tok, rng = CharTokenizer(), random.Random(0)
    copy, reverse = get_task("copy", 3), get_task("reverse", 3)
    torch.manual_seed(0)
    model = gpt.build_policy(cfg)
    forward.set_forward(model, "fused")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(150):
        prompts = copy.prompts(64, seed=i)
        rows = [
            tok.encode(p) + tok.encode((copy if rng.random() < 0.2 else reverse).target(p)) + [tok.eos_id]
            for p in prompts
        ]
        x = torch.tensor(rows)
        logits = forward.policy_logits(model, x[:, :-1])[:, 3:]  # the answer's positions
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 4:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_model_checkpoint(model, cfg, out, role="policy")


@pytest.mark.slow
@pytest.mark.server
def test_a_lora_policy_learns_copy_through_a_real_server(tmp_path):
    """Only the adapters train (rank 8 on every linear, 2% of the weights): the copy reward goes
    from the base's ~0.45 to >= 0.9 in 100 steps of 64 samples; the first step's KL is 0 (the
    reference is the base, the adapters start at B = 0); generation runs on merged weights
    (its log-probs agree with the training forward's); the checkpoint holds the adapters; the
    HF export (merged) answers the task in transformers, with the peft adapter beside it."""
    from _actor_runs import FAST, best_window, check_hf_export, digit_server, run_actor

    from aligner.actor.checkpointing import LORA_DIR
    from aligner.checkpoint import complete_steps, step_dir_name

    _pretrain_base(tmp_path / "base")
    with digit_server(tmp_path, "copy") as server:
        rows = run_actor(
            server.url,
            tmp_path / "run",
            [
                "data.task=copy",
                *FAST,
                "tokenizer=char",
                f"init_from={tmp_path / 'base'}",
                "ppo.num_steps=100",
                "ppo.global_batch_size=64",
                "lora.rank=8",
                "lora.alpha=16",
                "optim.lr=3e-3",
                "optim.min_lr=3e-3",
                "validation.interval=0",
                "validation.before_train=false",
                "checkpoint.save_interval=50",
                f"checkpoint.export_hf={tmp_path / 'hf'}",
            ],
        )
    scores = [round(r["objective/scores"], 3) for r in rows]
    assert len(rows) == 100 and rows[0]["objective/kl"] == 0.0
    assert sum(scores[:5]) / 5 < 0.6, scores[:5]
    assert best_window(rows) >= 0.9, scores[::10]
    assert max(r["rollout/logprob_mismatch_mean"] for r in rows) < 2e-2
    ckpt = tmp_path / "run" / "checkpoints"
    assert complete_steps(ckpt, role="actor") == [50, 100]
    assert (ckpt / step_dir_name(100) / "actor" / LORA_DIR / "adapter.safetensors").is_file()
    assert not (ckpt / step_dir_name(100) / "actor" / "policy").exists()
    check_hf_export(tmp_path / "hf", task="copy")
    assert (tmp_path / "hf" / "peft_adapter" / "adapter_config.json").is_file()

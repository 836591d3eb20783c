"""Builders for the three Megatron-core GPT variants that share one trunk.

- policy: the usual LM head (vocab-parallel logits under TP);
- critic: a scalar value per token;
- reward model: a scalar per sample, read at the sample's last token.

The critic and reward model are Megatron's ``GPTModel`` whose ``output_layer`` is replaced by
a :class:`ScalarHead` (as NeMo-Aligner does), so the trunk's parameter names, tensor/pipeline
parallel layout and HF conversion are the same for all three. Each built model carries its
head (``model.aligner_head``: ``"lm"``, ``"value"`` or ``"reward"``) and its
:class:`ModelConfig` (``model.aligner_config``); :func:`head_of` and :func:`config_of` read them.
Their forwards (logits, values, scores) are :mod:`aligner.models.forward`'s.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from aligner import cpu_compat
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.rope import inverse_frequencies

__all__ = [
    "ROLES",
    "ScalarHead",
    "transformer_config",
    "install_rope_frequencies",
    "sum_qk_norm_grads_over_tp",
    "build_policy",
    "build_critic",
    "build_reward_model",
    "role_head",
    "build_model",
    "config_of",
    "head_of",
    "position_ids_for",
    "unwrap",
    "tensor_state_dict",
    "load_state_dict_strict",
    "shape_mismatches",
]


class ScalarHead(nn.Module):
    """A linear map from the final hidden state to one number per position.

    Replicated on every TP rank (it is tiny and its input is already replicated), and shaped
    like an output layer so ``GPTModel`` calls it in place of the LM head.
    Initialisation follows "The N+ implementation details of RLHF with PPO" (Huang et al.,
    2024): weight ~ N(0, 1/sqrt(d+1)), bias 0.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        # From a generator of its own, seeded with the run's seed: the same head whatever the
        # layout (how many numbers the sharded layers drew before it depends on TP and PP).
        g = torch.Generator().manual_seed(torch.initial_seed())
        w = torch.randn(1, hidden_size, generator=g) / math.sqrt(hidden_size + 1)
        self.weight = nn.Parameter(w.to(dtype))
        # Megatron's grad-norm and sync helpers look for these attributes.
        for p in (self.weight, self.bias):
            p.tensor_model_parallel = False
            p.sequence_parallel = False

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """hidden [s, b, h] -> ([s, b, 1] float32, None), the output-layer calling convention.

        Computed in fp32 whatever the weights' dtype: values and scores feed GAE and the value
        loss, and a bf16 value (8 bits of mantissa) would be off by ~0.4% of its size.
        """
        return F.linear(hidden.float(), self.weight.float(), self.bias.float()), None


def _activation(name: str):
    return {
        "swiglu": F.silu,
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": partial(F.gelu, approximate="tanh"),
        "relu": F.relu,
    }[name]


def transformer_config(
    cfg: ModelConfig,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
):
    """The Megatron ``TransformerConfig`` for ``cfg`` on a given TP x PP layout.

    ``cfg.recompute == 'full'``: Megatron's full activation recompute, one layer per checkpoint
    (``recompute_method='uniform'``, ``recompute_num_layers=1``); the fused forward
    (:mod:`aligner.models.fused`) reads ``recompute_granularity`` and checkpoints every layer
    likewise."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg.check_parallel(tensor_parallel_size, pipeline_parallel_size)
    recompute = {}
    if cfg.recompute == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.kv_heads,
        ffn_hidden_size=cfg.ffn_size,
        kv_channels=cfg.head_dim,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        layernorm_epsilon=cfg.norm_epsilon,
        normalization=cfg.normalization,
        gated_linear_unit=cfg.activation == "swiglu",
        activation_func=_activation(cfg.activation),
        add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias or cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm,
        init_method_std=cfg.init_method_std,
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        pipeline_dtype=params_dtype,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # Initialise the full weight on the CPU and then take this rank's shard, so a model
        # built at TP=2 holds exactly the shards of the same model built at TP=1.
        use_cpu_initialization=True,
        # Fused kernels need Apex/TransformerEngine/CUDA; the plain paths are exact.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        **recompute,
    )


def _build(
    cfg: ModelConfig,
    head: str,
    tensor_parallel_size: int | None,
    pipeline_parallel_size: int | None,
    pre_process: bool | None,
    post_process: bool | None,
    params_dtype: torch.dtype,
):
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cpu_compat.apply()
    tp = tensor_parallel_size or mpu.get_tensor_model_parallel_world_size()
    pp = pipeline_parallel_size or mpu.get_pipeline_model_parallel_world_size()
    if pre_process is None:
        pre_process = mpu.is_pipeline_first_stage()
    if post_process is None:
        post_process = mpu.is_pipeline_last_stage()
    tcfg = transformer_config(cfg, tp, pp, params_dtype)
    # q/k norms: the model's norm over each head's width (torch RMSNorm/LayerNorm of
    # kv_channels), applied to queries and keys before RoPE, as HF's Qwen3 does.
    spec = get_gpt_layer_local_spec(normalization=cfg.normalization, qk_layernorm=cfg.qk_layernorm)
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.padded_vocab_size(tp),
        max_sequence_length=cfg.max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings and head == "lm",
        position_embedding_type=cfg.position_embedding,
        rotary_base=cfg.rotary_base,  # a float theta is used as is
    )
    if cfg.position_embedding == "rope":
        install_rope_frequencies(model, cfg)
    if cfg.recompute != "none" and pre_process:
        model.embedding.register_forward_hook(_output_requires_grad)
    if head != "lm" and post_process:
        model.output_layer = ScalarHead(cfg.hidden_size, dtype=params_dtype)
    if params_dtype != torch.float32:
        # Megatron's local-spec norms (torch RMSNorm/LayerNorm) keep fp32 weights whatever
        # params_dtype says; bf16 activations against fp32 norm weights take torch's slow
        # mixed-dtype path. The whole model is one dtype, as Megatron's Float16Module makes it.
        model.to(dtype=params_dtype)
    if cfg.qk_layernorm and tp > 1:
        sum_qk_norm_grads_over_tp(model, mpu.get_tensor_model_parallel_group())
    model.aligner_head = head  # "lm", "value" or "reward"
    model.aligner_config = cfg
    return model


def _output_requires_grad(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output marked as requiring grad while gradients are recorded. Megatron's
    recompute checkpoints layers with a reentrant autograd ``Function``, whose outputs require
    grad only when its tensor inputs do: with frozen embeddings (LoRA) the adapters in the
    layers would get no gradient (HF's ``enable_input_require_grads`` does the same)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_()
    return output


def install_rope_frequencies(model: nn.Module, cfg: ModelConfig) -> None:
    """Put ``cfg``'s RoPE frequencies (:func:`aligner.models.rope.inverse_frequencies`, with its
    ``rope_scaling``) into the model's rotary embedding, where Megatron's forward, the fused
    forward and the lean decoder all read them (``model.rotary_pos_emb.inv_freq``).

    Megatron computes plain frequencies itself; its own llama3 scaling fixes three of the four
    parameters, so scaled ones are computed here, as transformers computes them. Call before
    the model's first forward: its rotary embedding caches its tables per length."""
    rotary = model.rotary_pos_emb
    mine = inverse_frequencies(cfg, device=rotary.inv_freq.device)
    if mine.shape != rotary.inv_freq.shape:  # pragma: no cover - partial rotary is never built
        raise ConversionError(
            f"rotary embedding has {rotary.inv_freq.numel()} frequencies, the config {mine.numel()}"
        )
    if cfg.rope_scaling is not None:
        rotary.inv_freq = mine


def _summed_over(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.detach().clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    return hook


def sum_qk_norm_grads_over_tp(model: nn.Module, tp_group) -> int:
    """Make every tensor-parallel rank's gradient of the q/k norm weights the whole model's.

    The q/k norms are replicated (one head's width, shared by every head), but each TP rank
    applies them to its own heads only, so its backward holds its heads' share of their
    gradient. A hook on each of these parameters sums the shares over ``tp_group`` as the
    backward computes them (Megatron does it in ``finalize_model_grads``, which this project's
    trainers do not call), whichever forward runs (Megatron's, fused); the replicas then stay
    equal through optimizer steps, and a gradient norm counts them once as it counts every
    replicated weight. Collective within the backward, in the same place on every TP rank.
    Returns how many parameters got a hook."""
    n = 0
    for name, p in model.named_parameters():
        if ".q_layernorm." in name or ".k_layernorm." in name:
            p.register_hook(_summed_over(tp_group))
            n += 1
    return n


def build_policy(
    cfg: ModelConfig,
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
):
    """A GPT with an LM head. Call after :func:`aligner.distributed.initialize`."""
    return _build(
        cfg, "lm", tensor_parallel_size, pipeline_parallel_size, pre_process, post_process, params_dtype
    )


def build_critic(
    cfg: ModelConfig,
    *,
    init_from=None,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
):
    """A GPT with a value head (one value per token).

    ``init_from``: a reward model (or its state dict) of the same shape to start from, as the
    N+ implementation details recommend; otherwise a fresh trunk and an N(0, 1/sqrt(d+1)) head.
    """
    model = _build(
        cfg, "value", tensor_parallel_size, pipeline_parallel_size, pre_process, post_process, params_dtype
    )
    if init_from is not None:
        state = init_from.state_dict() if isinstance(init_from, nn.Module) else init_from
        load_state_dict_strict(model, state, what="critic initialised from the reward model")
    return model


def build_reward_model(
    cfg: ModelConfig,
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
):
    """A GPT with a scalar head read at each sample's last token."""
    return _build(
        cfg, "reward", tensor_parallel_size, pipeline_parallel_size, pre_process, post_process, params_dtype
    )


#: Our roles -> the head of the Megatron model (``model.aligner_head``).
ROLES: dict[str, str] = {"policy": "lm", "critic": "value", "reward": "reward"}


def role_head(role: str) -> str:
    """The head of ``role``'s model (:data:`ROLES`); an unknown role is a :class:`ConversionError`."""
    if role not in ROLES:
        raise ConversionError(f"role={role!r}: expected one of {sorted(ROLES)}")
    return ROLES[role]


def build_model(cfg: ModelConfig, role: str = "policy", params_dtype: torch.dtype = torch.float32):
    """Build the Megatron model of ``role`` for ``cfg`` on the current TP/PP layout."""
    builder = {"policy": build_policy, "critic": build_critic, "reward": build_reward_model}
    role_head(role)
    return builder[role](cfg, params_dtype=params_dtype)


def config_of(model: nn.Module, cfg: ModelConfig | None = None) -> ModelConfig:
    """``cfg`` when given, else the config the model was built with (``model.aligner_config``)."""
    if cfg is not None:
        return cfg
    found = getattr(model, "aligner_config", None)
    if not isinstance(found, ModelConfig):
        raise ConversionError("no model config given and the model has no aligner_config")
    return found


def head_of(model: nn.Module) -> str:
    """The model's head, ``"lm"``, ``"value"`` or ``"reward"`` (``model.aligner_head``)."""
    head = getattr(model, "aligner_head", None)
    if head not in ("lm", "value", "reward"):
        raise ConversionError("the model has no aligner_head; build it with aligner.models.gpt")
    return head


def tensor_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by name, without Megatron's ``_extra_state`` placeholders and without
    LoRA adapters (``...lora_A``/``...lora_B``, :mod:`aligner.models.lora`): the base model's."""
    return {
        k: v
        for k, v in model.state_dict().items()
        if isinstance(v, torch.Tensor) and not k.endswith(("_extra_state", ".lora_A", ".lora_B"))
    }


def shape_mismatches(expected: dict[str, tuple], got: dict[str, tuple], most: int = 8) -> list[str]:
    """How ``got`` (tensor name -> shape) differs from ``expected``: missing names, unexpected
    names and wrong shapes, each listed up to ``most`` entries; empty when they agree."""

    def listed(names: list[str]) -> str:
        return f"{names[:most]}{' ...' if len(names) > most else ''}"

    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [
        f"{k}: expected {tuple(expected[k])}, got {tuple(got[k])}"
        for k in sorted(set(expected) & set(got))
        if tuple(got[k]) != tuple(expected[k])
    ]
    parts = []
    if missing:
        parts.append(f"missing {listed(missing)}")
    if unexpected:
        parts.append(f"unexpected {listed(unexpected)}")
    if wrong:
        parts.append("shape mismatch " + "; ".join(wrong[:most]))
    return parts


def load_state_dict_strict(model: nn.Module, state: dict, what: str = "model") -> None:
    """Load ``state`` into ``model``, failing with the names and shapes that do not match."""
    own = tensor_state_dict(model)
    given = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    problems = shape_mismatches(
        {k: tuple(v.shape) for k, v in own.items()}, {k: tuple(v.shape) for k, v in given.items()}
    )
    if problems:
        raise ValueError(f"cannot load {what}: " + ", ".join(problems))
    with torch.no_grad():
        for k, v in given.items():
            own[k].copy_(v)


def unwrap(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (their forward adds only casts)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def position_ids_for(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, s] -> position ids [b, s] (0..s-1; right padding needs no offsets)."""
    b, s = tokens.shape
    return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)

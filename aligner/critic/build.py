"""How a critic server's parts are built from its configuration: the tokenizer, the reward sources
(:mod:`aligner.critic.reward_fn`, :mod:`aligner.critic.reward_model`), where the critic's weights
start (``init.source``), the critic and its optimiser, the forwards, the limits the server
advertises, and the collaborators :class:`~aligner.critic.service.CriticService` composes (the
value update, the line to the other ranks, the replicas, the checkpoints). The service keeps the
rules; this module only assembles what they act on.

Where the critic starts (``init.source``): ``reward`` copies the reward model (same architecture and
TP layout: its shards are the critic's; the critic takes its architecture), ``policy`` copies a
policy's trunk from ``init.policy_path`` (this project's checkpoint folder or a HF causal LM) and
keeps a fresh value head (the critic takes the policy's architecture), ``fresh`` builds the
``model`` section. ``auto`` takes the reward model when there is one that reads the policy's ids,
else the policy when ``init.policy_path`` is set, else fresh. In reward-only mode nothing is built
(``none``).

Every loader here is collective under TP (each rank takes its shard of full tensors), and
:func:`build_parts` gathers every rank's place: every rank calls it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aligner.critic.checkpointing import CriticCheckpoints
from aligner.critic.config import CriticServerConfig, LimitsConfig
from aligner.critic.errors import CriticServiceError
from aligner.critic.peers import PeerLink
from aligner.critic.replicas import Layout, Replicas
from aligner.critic.reward_fn import RewardFn, load_reward_fn
from aligner.critic.reward_model import RewardTokens, load_reward_model
from aligner.critic.value_update import ValueUpdate
from aligner.distributed import ParallelState
from aligner.models.checkpoint_io import read_checkpoint_meta
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.forward import set_forwards
from aligner.models.gpt import build_critic, load_state_dict_strict, tensor_state_dict
from aligner.models.hf import load_hf_into_megatron
from aligner.models.hf_config import model_config_from_hf
from aligner.models.layout import load_megatron_tensors
from aligner.precision import make_optimizer, precision_dtype, resolve_precision
from aligner.tokenizers import Tokenizer, build_tokenizer
from aligner.wire.protocol import Limits

__all__ = [
    "CriticParts",
    "build_parts",
    "REWARD_ONLY_MAX_SEQ_LEN",
    "HEAD_TENSORS",
    "policy_init_config",
    "load_policy_trunk",
]

log = logging.getLogger("aligner.critic")

REWARD_ONLY_MAX_SEQ_LEN = LimitsConfig.reward_only_max_seq_len
"""The longest sample a reward-only server without a reward model on the policy's ids accepts by
default (``limits.reward_only_max_seq_len``)."""

HEAD_TENSORS = frozenset({"output_layer.weight", "output_layer.bias"})
"""The scalar head's tensors (what a policy's trunk does not provide)."""


@dataclass
class CriticParts:
    """What a :class:`~aligner.critic.service.CriticService` is made of (its attributes of the
    same names)."""

    reward_only: bool
    """No critic: the server scores responses and nothing else (``mode: reward_only``)."""
    tokenizer: Tokenizer
    """The policy's tokenizer (``tokenizer``): what the critic's ids and the reward function's text are."""
    reward_fn: RewardFn | None
    reward_model: torch.nn.Module | None
    """Frozen, on the device, in the compute dtype."""
    rm_cfg: ModelConfig | None
    reward_tokens: RewardTokens | None
    """The reward model's own tokenizer when it reads text (None: it reads the critic's ids)."""
    init_source: str
    """Where the critic's weights started: ``reward``, ``policy``, ``fresh`` or ``none`` (reward-only)."""
    model_cfg: ModelConfig
    """The critic's architecture (in reward-only mode, the shape the limits come from)."""
    precision: str
    critic: torch.nn.Module | None
    optimizer: Any
    model_forward: dict[str, str]
    """Model name -> the forward it runs (:func:`aligner.models.forward.set_forwards`)."""
    update: ValueUpdate
    limits: Limits
    peers: PeerLink
    replicas: Replicas
    checkpoints: CriticCheckpoints | None
    """The critic's checkpoints (None in reward-only mode: there is nothing to save)."""


def build_parts(cfg: CriticServerConfig, state: ParallelState, lock: threading.Lock) -> CriticParts:
    """Build every part of a critic server on this rank (collective: every rank calls it).

    Args:
        lock: the service's lock, which the heartbeat to idle peers takes (:class:`PeerLink`).

    Raises:
        CriticServiceError: parts that cannot belong together (a vocabulary smaller than its
            tokenizer's, a reward model that reads text asked to seed the critic, a chat template
            the reward tokenizer lacks).
    """
    is_rank0 = state.rank == 0
    tokenizer = build_tokenizer(cfg.tokenizer)
    reward_only = cfg.mode == "reward_only"
    r = cfg.reward
    reward_fn = (
        load_reward_fn(r.fn, dict(r.fn_kwargs), list(r.python_path), **r.fn_options()) if r.fn else None
    )
    # Every loader below is collective under TP (each rank takes its shard of full tensors).
    reward_model, rm_cfg = load_reward_model(r.model_path, r.hf_path)
    reward_tokens = _reward_tokens(cfg, tokenizer, reward_model, rm_cfg)
    init_source = "none" if reward_only else _init_source(cfg, reward_model, reward_tokens)
    model_cfg = _critic_config(cfg, init_source, rm_cfg)
    rm_tokenizer = (cfg.tokenizer, tokenizer)
    if reward_tokens is not None:
        rm_tokenizer = (reward_tokens.spec, reward_tokens.tokenizer)
    for what, c, (spec, tok) in (
        ("critic", None if reward_only else model_cfg, (cfg.tokenizer, tokenizer)),
        ("reward model", rm_cfg, rm_tokenizer),
    ):
        if c is not None and c.vocab_size < tok.vocab_size:
            raise CriticServiceError(
                f"the {what}'s vocab_size={c.vocab_size} is smaller than tokenizer "
                f"{spec!r}'s {tok.vocab_size}: they cannot belong together"
            )
    precision = resolve_precision(cfg.precision, state.device)
    # Built and initialised in fp32; the optimizer keeps those values as its fp32 master
    # weights and casts the critic to bf16 (so the starting point is not rounded).
    critic = None if reward_only else build_critic(model_cfg)
    if init_source == "reward":
        # Same architecture and TP layout: the reward model's shards are the critic's.
        load_state_dict_strict(
            critic, tensor_state_dict(reward_model), what="critic initialised from the reward model"
        )
    elif init_source == "policy":
        load_policy_trunk(critic, cfg.init.policy_path)
    # Built (and loaded) on the CPU, as Megatron's use_cpu_initialization does; then moved.
    if critic is not None:
        critic.to(state.device)
    if reward_model is not None:
        reward_model.to(state.device, precision_dtype(precision))
    o = cfg.optim
    optimizer = None
    if critic is not None:
        # optim.use_distributed_optimizer: the masters and moments sharded over the replicas
        # (every replica takes the same step, so each keeps a slice and they gather the weights).
        shard = o.use_distributed_optimizer and state.dp_size > 1
        optimizer = make_optimizer(
            critic,
            **o.adamw(),
            precision=precision,
            dp_group=state.dp_group if shard else None,
        )
    # After the optimizer, which casts the critic to its compute dtype.
    model_forward = set_forwards(
        {"critic": critic, "reward model": reward_model},
        cfg.model_forward,
        state.tp_size,
        log if is_rank0 else None,
    )
    update = ValueUpdate(
        critic, optimizer, reward_model, cfg, state, reward_reads_text=reward_tokens is not None
    )
    limits = _limits(
        cfg, tokenizer, model_cfg, rm_cfg, reads_ids=rm_cfg is not None and reward_tokens is None
    )
    if is_rank0:
        log.info(
            "%s ready: %s, init=%s, reward fn=%s, reward model=%s%s, TP=%d, DP=%d, precision=%s",
            "reward-only server (no critic)" if reward_only else "critic",
            "no critic" if reward_only else model_cfg,
            init_source,
            reward_fn,
            r.model_path or r.hf_path,
            f" (reads text, tokenizer {reward_tokens.spec})" if reward_tokens else "",
            state.tp_size,
            state.dp_size,
            precision,
        )
    layout = Layout.gather(state)  # collective: before the heartbeat can broadcast
    # On rank 0 of a world of several ranks this starts the heartbeat.
    peers = PeerLink(state, lock, cfg.parallel.peer_timeout_s)
    replicas = Replicas(state, layout, peers, update)
    checkpoints = None
    if critic is not None:
        checkpoints = CriticCheckpoints(
            Path(cfg.checkpoint.dir),
            cfg.checkpoint.keep_last,
            critic,
            optimizer,
            model_cfg,
            state,
            peers,
            layout,
        )
    return CriticParts(
        reward_only=reward_only,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        reward_model=reward_model,
        rm_cfg=rm_cfg,
        reward_tokens=reward_tokens,
        init_source=init_source,
        model_cfg=model_cfg,
        precision=precision,
        critic=critic,
        optimizer=optimizer,
        model_forward=model_forward,
        update=update,
        limits=limits,
        peers=peers,
        replicas=replicas,
        checkpoints=checkpoints,
    )


def _reward_tokens(
    cfg: CriticServerConfig,
    tokenizer: Tokenizer,
    reward_model: torch.nn.Module | None,
    rm_cfg: ModelConfig | None,
) -> RewardTokens | None:
    """The reward model's tokenizer, when it has one of its own that is not the policy's (by
    fingerprint): the reward model then reads the samples' text."""
    r = cfg.reward
    spec = r.tokenizer_spec
    if reward_model is None or spec is None:
        return None
    tok = build_tokenizer(spec)
    if tok.fingerprint() == tokenizer.fingerprint():
        return None
    try:
        return RewardTokens(tok, spec, rm_cfg.max_seq_len, chat_template=r.chat_template)
    except ValueError as e:
        raise CriticServiceError(str(e)) from None


def _limits(
    cfg: CriticServerConfig,
    tokenizer: Tokenizer,
    model_cfg: ModelConfig,
    rm_cfg: ModelConfig | None,
    *,
    reads_ids: bool,
) -> Limits:
    """What the server accepts. ``reads_ids``: a reward model reads the policy's ids (one that
    reads text cuts its own sequences to its length). Without a critic only such a reward model
    bounds the length (a reward function takes any)."""
    if cfg.mode == "reward_only":
        max_len = rm_cfg.max_seq_len if reads_ids else cfg.limits.reward_only_max_seq_len
    else:
        max_len = min(model_cfg.max_seq_len, rm_cfg.max_seq_len) if reads_ids else model_cfg.max_seq_len
    return Limits(
        vocab_size=tokenizer.vocab_size,
        max_seq_len=max_len,
        max_batch=cfg.server.max_batch_size,
        max_train_batch=cfg.server.max_request_batch,
    )


# ----------------------------------------------------------------------------------------------
# Where the critic's weights start (init.source)
# ----------------------------------------------------------------------------------------------


def _init_source(
    cfg: CriticServerConfig, reward_model: torch.nn.Module | None, reward_tokens: RewardTokens | None
) -> str:
    """``init.source`` with ``auto`` resolved (a server with a critic)."""
    source = cfg.init.source
    reads_text = reward_tokens is not None
    if source == "auto":
        # A reward model that reads text with its own tokenizer cannot seed the critic, which
        # reads the policy's ids: the critic then starts from the policy (or fresh).
        if reward_model is not None and not reads_text:
            return "reward"
        return "policy" if cfg.init.policy_path else "fresh"
    if source == "reward" and reads_text:
        raise CriticServiceError(
            f"init.source='reward': the reward model reads text with its own tokenizer "
            f"({reward_tokens.spec!r}) while the critic reads the policy's token ids "
            f"(tokenizer={cfg.tokenizer!r}); start the critic from init.policy_path, or fresh"
        )
    return source


def _critic_config(cfg: CriticServerConfig, init_source: str, rm_cfg: ModelConfig | None) -> ModelConfig:
    """The critic's architecture: the reward model's or the policy's when it starts from one,
    with the ``model`` section's settings that are no part of an architecture (``recompute``).
    In reward-only mode no critic is built; this is then the shape the limits come from (the
    reward model's, else the ``model`` section's ``max_seq_len``)."""
    if init_source == "none":
        return rm_cfg if rm_cfg is not None else cfg.model
    if init_source == "reward":
        diff = rm_cfg.architecture_diff(cfg.model)
        if diff:
            log.warning(
                "the critic starts from the reward model, so it takes the reward model's "
                "architecture; model.* settings that differ are ignored: %s",
                "; ".join(diff),
            )
        return rm_cfg.with_runtime_of(cfg.model)
    if init_source == "policy":
        return policy_init_config(cfg.init.policy_path).with_runtime_of(cfg.model)
    return cfg.model


def policy_init_config(path: str):
    """The architecture of ``init.policy_path``: this project's checkpoint folder (``meta.json``)
    or a Hugging Face folder (``config.json``, e.g. a causal LM)."""
    folder = Path(path)
    if (folder / "meta.json").is_file():
        return read_checkpoint_meta(folder)["model_config"]
    return model_config_from_hf(folder)


def load_policy_trunk(critic: torch.nn.Module, path: str) -> None:
    """Copy a policy's trunk (everything but the LM head) into ``critic``, keeping the critic's
    fresh value head (collective under TP, like every loader here). ``path``: this project's
    checkpoint folder, or a Hugging Face folder (a causal LM: the weight stream reads it)."""
    folder = Path(path)
    if not (folder / "meta.json").is_file():
        # A causal LM's trunk; the critic keeps its fresh scalar head.
        load_hf_into_megatron(critic, folder, critic.aligner_config)
        return
    saved = policy_init_config(path)
    diff = critic.aligner_config.architecture_diff(saved)
    if diff:
        raise ConversionError(f"init.policy_path={path!r} holds a different architecture: {'; '.join(diff)}")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        load_megatron_tensors(critic, critic.aligner_config, fh.get_tensor, skip=HEAD_TENSORS)

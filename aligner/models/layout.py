"""The canonical Megatron tensors of a model and their tensor/pipeline-parallel layout.

:func:`megatron_tensor_specs` lists, for a :class:`ModelConfig` and a head (``"lm"``,
``"value"``, ``"reward"``), every tensor of the model as it is at TP=1/PP=1: Megatron's own
names with *global* layer numbers, the vocabulary *un-padded*. :class:`ParallelLayout` says
where each of them lives under TP x PP (which pipeline stage holds it, under which local name,
how tensor parallelism splits it) and cuts or joins the shards.

On top of that, the weight stream: :func:`iter_megatron_tensors` streams the full tensors out
of a (TP/PP-sharded) model and :func:`load_megatron_tensors` puts full tensors back as this
rank's shards. It is the one weight stream of the package: our own checkpoint format
(:mod:`aligner.models.checkpoint_io`) is exactly this stream written to safetensors, the HF
export (:func:`aligner.models.hf.iter_hf_tensors`) is this stream renamed, and a generation
engine that owns its weights should refit from it too (it yields full tensors, whatever the
training layout, for the engine to shard its own way).

Collective contract of the stream: every rank of the world must iterate it to the end, in the
same order (it all-gathers over the TP group of the stage that holds a tensor and broadcasts
from that stage over the PP group), and **every rank yields every full tensor**, so any rank
can consume it. Yielded tensors may share storage with the model's parameters: copy them if
you keep them past a parameter update. Loading is local to each rank's stage except for
tensors it is told to skip, which are broadcast within the TP group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aligner.models.config import ConversionError, ModelConfig
from aligner.models.gpt import config_of, head_of, shape_mismatches, tensor_state_dict, unwrap
from aligner.models.lora import merged_weights

__all__ = [
    "WeightSpec",
    "megatron_tensor_specs",
    "ParallelLayout",
    "check_local_model",
    "iter_megatron_tensors",
    "load_megatron_tensors",
    "bucketed",
    "weight_layout_diff",
]


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of the full (TP=1, PP=1, un-padded vocab) Megatron model."""

    name: str
    """Megatron's name with the global layer number."""
    shape: tuple[int, ...]
    split: str
    """How TP shards it: 'replicated', 'column' (rows), 'row' (columns), 'glu' ([gate; up]
    rows, each half sharded) or 'vocab' (rows, padded to the padded vocabulary)."""
    place: str
    """'first' (first PP stage), 'last' (last PP stage) or 'layer'."""
    layer: int | None = None


def megatron_tensor_specs(cfg: ModelConfig, head: str = "lm") -> list[WeightSpec]:
    """Every tensor of the model in a fixed order (the same on every rank)."""
    if head not in ("lm", "value", "reward"):
        raise ConversionError(f"unknown model head {head!r}; expected 'lm', 'value' or 'reward'")
    H, V, F = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    heads, kv, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    qkv_rows = (heads + 2 * kv) * d
    norms = ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",)
    bias = cfg.add_bias_linear
    qkv_bias = cfg.add_qkv_bias or cfg.add_bias_linear
    glu = cfg.activation == "swiglu"
    out = [WeightSpec("embedding.word_embeddings.weight", (V, H), "vocab", "first")]
    if cfg.position_embedding == "learned_absolute":
        out.append(
            WeightSpec("embedding.position_embeddings.weight", (cfg.max_seq_len, H), "replicated", "first")
        )
    for i in range(cfg.num_layers):
        p = f"decoder.layers.{i}."

        def add(suffix: str, shape: tuple[int, ...], split: str, p: str = p, i: int = i) -> None:
            out.append(WeightSpec(p + suffix, shape, split, "layer", i))

        for s in norms:
            add(f"input_layernorm.{s}", (H,), "replicated")
        add("self_attention.linear_qkv.weight", (qkv_rows, H), "column")
        if qkv_bias:
            add("self_attention.linear_qkv.bias", (qkv_rows,), "column")
        if cfg.qk_layernorm:
            # One head's norm, shared by every head: replicated under TP.
            for which in ("q", "k"):
                for s in norms:
                    add(f"self_attention.{which}_layernorm.{s}", (d,), "replicated")
        add("self_attention.linear_proj.weight", (H, heads * d), "row")
        if bias:
            add("self_attention.linear_proj.bias", (H,), "replicated")
        for s in norms:
            add(f"pre_mlp_layernorm.{s}", (H,), "replicated")
        add("mlp.linear_fc1.weight", ((2 if glu else 1) * F, H), "glu" if glu else "column")
        if bias:
            add("mlp.linear_fc1.bias", ((2 if glu else 1) * F,), "glu" if glu else "column")
        add("mlp.linear_fc2.weight", (H, F), "row")
        if bias:
            add("mlp.linear_fc2.bias", (H,), "replicated")
    for s in norms:
        out.append(WeightSpec(f"decoder.final_layernorm.{s}", (H,), "replicated", "last"))
    if head == "lm":
        if not cfg.tie_embeddings:
            out.append(WeightSpec("output_layer.weight", (V, H), "vocab", "last"))
    else:
        out.append(WeightSpec("output_layer.weight", (1, H), "replicated", "last"))
        out.append(WeightSpec("output_layer.bias", (1,), "replicated", "last"))
    return out


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the TP x PP layout, and where each canonical tensor lives in it."""

    tp: int = 1
    tp_rank: int = 0
    tp_group: Any = None
    pp: int = 1
    pp_rank: int = 0
    pp_group: Any = None

    @classmethod
    def current(cls) -> ParallelLayout:
        """The layout Megatron's parallel state was initialised with (TP=PP=1 when it was not)."""
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            return cls()
        return cls(
            tp=mpu.get_tensor_model_parallel_world_size(),
            tp_rank=mpu.get_tensor_model_parallel_rank(),
            tp_group=mpu.get_tensor_model_parallel_group(),
            pp=mpu.get_pipeline_model_parallel_world_size(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_group=mpu.get_pipeline_model_parallel_group(),
        )

    def owner(self, spec: WeightSpec, cfg: ModelConfig) -> int:
        """The pipeline stage that holds ``spec``."""
        if spec.place == "first":
            return 0
        if spec.place == "last":
            return self.pp - 1
        assert spec.layer is not None
        return spec.layer // (cfg.num_layers // self.pp)

    def local_name(self, spec: WeightSpec, cfg: ModelConfig) -> str:
        """``spec``'s name in its stage's module (layer numbers local to the stage)."""
        if spec.layer is None:
            return spec.name
        offset = self.owner(spec, cfg) * (cfg.num_layers // self.pp)
        prefix = f"decoder.layers.{spec.layer}."
        return f"decoder.layers.{spec.layer - offset}." + spec.name[len(prefix) :]

    def targets(self, cfg: ModelConfig, head: str) -> list[tuple[WeightSpec, str]]:
        """(spec, local name) of every tensor this rank holds."""
        out = [
            (s, self.local_name(s, cfg))
            for s in megatron_tensor_specs(cfg, head)
            if self.owner(s, cfg) == self.pp_rank
        ]
        if head == "lm" and cfg.tie_embeddings and self.pp > 1 and self.pp_rank == self.pp - 1:
            # The last stage keeps its own copy of the tied embedding as the LM head.
            emb = megatron_tensor_specs(cfg, head)[0]
            out.append((emb, "output_layer.weight"))
        return out

    def shard_shape(self, spec: WeightSpec, cfg: ModelConfig) -> tuple[int, ...]:
        """The shape of this rank's shard of ``spec``."""
        s, tp = list(spec.shape), self.tp
        if spec.split == "vocab":
            s[0] = cfg.padded_vocab_size(tp) // tp
        elif spec.split in ("column", "glu"):
            s[0] //= tp
        elif spec.split == "row":
            s[1] //= tp
        return tuple(s)

    def shard(self, full: torch.Tensor, spec: WeightSpec, cfg: ModelConfig) -> torch.Tensor:
        """This rank's shard of the full tensor ``full`` of ``spec``: a view of ``full`` where the
        shard is one slice of it (a copy for a fused gate/up pair under TP > 1, and for the
        vocabulary shard that reaches into the padding, whose padded rows are zeros)."""
        tp, r = self.tp, self.tp_rank
        if tp == 1 and spec.split != "vocab":
            return full
        if spec.split == "vocab":
            rows = cfg.padded_vocab_size(tp) // tp
            start, real = r * rows, full.shape[0]
            if start + rows <= real:
                return full[start : start + rows]
            part = full[min(start, real) : real]  # only this shard is padded, never the full tensor
            return torch.cat([part, full.new_zeros(rows - part.shape[0], *full.shape[1:])])
        if spec.split == "column":
            return full.chunk(tp, 0)[r]
        if spec.split == "row":
            return full.chunk(tp, 1)[r]
        if spec.split == "glu":
            gate, up = full.chunk(2, 0)
            return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]])
        return full

    def gather(self, shard: torch.Tensor, spec: WeightSpec, cfg: ModelConfig) -> torch.Tensor:
        """The full tensor of ``spec`` from every TP rank's ``shard`` (the vocabulary un-padded).
        Collective over the TP group."""
        shard = shard.detach()
        if self.tp > 1 and spec.split != "replicated":
            shard = shard.contiguous()
            parts = [torch.empty_like(shard) for _ in range(self.tp)]
            dist.all_gather(parts, shard, group=self.tp_group)
            if spec.split in ("column", "vocab"):
                full = torch.cat(parts, 0)
            elif spec.split == "row":
                full = torch.cat(parts, 1)
            else:  # glu: each rank holds [gate_shard; up_shard]
                halves = [p.chunk(2, 0) for p in parts]
                full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
        else:
            full = shard
        if spec.split == "vocab":
            full = full[: cfg.vocab_size]
        return full


def check_local_model(model: torch.nn.Module, cfg: ModelConfig, head: str, lay: ParallelLayout) -> dict:
    """This rank's tensors of ``model`` by local name, after checking ``cfg`` fits the layout and
    every tensor has its shard's shape (:class:`ConversionError` naming each mismatch)."""
    cfg.check_parallel(lay.tp, lay.pp)
    local = tensor_state_dict(model)
    expected = {name: lay.shard_shape(spec, cfg) for spec, name in lay.targets(cfg, head)}
    problems = shape_mismatches(expected, {k: tuple(v.shape) for k, v in local.items()})
    if problems:
        raise ConversionError(
            f"the model on this rank (TP {lay.tp_rank}/{lay.tp}, PP {lay.pp_rank}/{lay.pp}) does not match "
            f"its model config: " + ", ".join(problems)
        )
    return local


def iter_megatron_tensors(
    model: torch.nn.Module, cfg: ModelConfig | None = None, *, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model's full canonical tensors (see :func:`megatron_tensor_specs`).

    Collective: every rank must iterate to the end. Each tensor is all-gathered over the TP
    group of the stage that holds it and broadcast from that stage over the PP group, so every
    rank yields every tensor. ``dtype`` casts (default: the model's parameter dtype).

    A model with LoRA adapters (:mod:`aligner.models.lora`) streams each adapted weight merged,
    ``W + (alpha / r) * B @ A`` (each shard merged in fp32 before the gather); the adapters
    themselves are not in the stream.
    """
    m = unwrap(model)
    cfg = config_of(m, cfg)
    head = head_of(m)
    lay = ParallelLayout.current()
    local = check_local_model(m, cfg, head, lay)
    merged = merged_weights(m)  # local name -> this shard merged; empty without LoRA
    mine = {s.name: n for s, n in lay.targets(cfg, head) if lay.owner(s, cfg) == lay.pp_rank}
    some = next(iter(local.values()))
    wire, device = dtype or some.dtype, some.device
    for spec in megatron_tensor_specs(cfg, head):
        owner = lay.owner(spec, cfg)
        if owner == lay.pp_rank:
            name = mine[spec.name]
            # Cast before the gather: the same values, and a narrower wire dtype moves fewer bytes.
            shard = merged[name](wire) if name in merged else local[name].to(wire)
            full = lay.gather(shard, spec, cfg)
        else:
            full = torch.empty(spec.shape, dtype=wire, device=device)
        if lay.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, group=lay.pp_group, group_src=owner)
        yield spec.name, full


def bucketed(
    stream: Iterable[tuple[str, torch.Tensor]], max_bytes: int | None
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a ``(name, tensor)`` stream into consecutive buckets of at most ``max_bytes``
    (a tensor larger than that is a bucket of its own), in stream order, so that a consumer
    (an engine's refit) takes a model piece by piece and never needs a second full copy of it.
    ``max_bytes`` None or 0: one bucket with everything.

    The stream is pulled lazily: a collective stream keeps its contract as long as the caller
    consumes every bucket."""
    if max_bytes is not None and (
        not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0
    ):
        raise ValueError(f"max_bytes={max_bytes!r}: expected an integer >= 0, or None for one bucket")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in stream:
        n = t.numel() * t.element_size()
        if bucket and max_bytes and size + n > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def load_megatron_tensors(
    model: torch.nn.Module,
    cfg: ModelConfig | None,
    get: Callable[[str], torch.Tensor],
    *,
    skip: frozenset | set = frozenset(),
) -> None:
    """Load full canonical tensors (``get(name)``) as this rank's shards of ``model``.

    Only the tensors of this rank's PP stage are requested. Names in ``skip`` keep their current
    values (e.g. a fresh scalar head); replicated ones are made equal across the TP group.
    """
    m = unwrap(model)
    cfg = config_of(m, cfg)
    head = head_of(m)
    lay = ParallelLayout.current()
    local = check_local_model(m, cfg, head, lay)
    with torch.no_grad():
        for spec, name in lay.targets(cfg, head):
            target = local[name]
            if spec.name in skip:
                if lay.tp > 1:
                    src = dist.get_global_rank(lay.tp_group, 0)
                    buf = target.detach().contiguous().clone()
                    dist.broadcast(buf, src=src, group=lay.tp_group)
                    target.copy_(buf)
                continue
            full = get(spec.name)
            if tuple(full.shape) != spec.shape:
                raise ConversionError(
                    f"tensor {spec.name}: expected shape {spec.shape}, got {tuple(full.shape)}"
                )
            target.copy_(lay.shard(full, spec, cfg))


def weight_layout_diff(given: ModelConfig, other: ModelConfig, head: str) -> list[str]:
    """``given.architecture_diff(other)`` less what does not change a ``head`` model's tensors:
    ``tie_embeddings`` for scalar heads, ``max_seq_len`` for rope models."""
    diff = given.architecture_diff(other)
    if head != "lm":
        diff = [x for x in diff if not x.startswith("tie_embeddings:")]
    if given.position_embedding == "rope" and other.position_embedding == "rope":
        diff = [x for x in diff if not x.startswith("max_seq_len:")]
    return diff

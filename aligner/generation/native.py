"""The native engine: KV-cache decoding on the training policy's Megatron-core module, or on
weights it owns in a generation layout of its own.

Design
------
*Ragged batches* (the lean backend; :mod:`aligner.generation.ragged`). Prompts of any mix of
lengths are encoded in one prefill forward, and every row starts generating at the first
step. A row's KV-cache slot is its position: row ``i``'s prompt fills slots
``[0, prompt_len[i])`` and its response token ``k`` goes to slot ``prompt_len[i] + k``, with
the RoPE angle (or learned position) of that position. No row ever attends to padding and no
position offsets exist, so the result equals decoding each prompt on its own (the tests check
this against a full recompute and against one-prompt batches, on prompts of 1 to 40 tokens).
The prefill packs the prompts end to end (the linears see only real tokens) and runs causal
attention per run of equally long rows; more than
:data:`~aligner.generation.steppers.PREFILL_TOKENS` (32768) prompt tokens are prefilled in
several forwards of whole rows, to bound the activations. Then each step feeds one token per
row at its own position. The rows are sorted by prompt length, longest first, for the whole
call: the eager step attends each *span* of rows of similar length
(:func:`~aligner.generation.decoder.attention_spans`: every row reads at least 90% of its
span's range, at most 16 spans) over that span's range under a per-row mask, so a short row
does not read the long rows' positions; the fixed-shape step (static, graph, compiled) attends
over the whole capacity under a per-row mask. Outputs go back in the caller's order.

*Stopped rows leave the batch.* Per step, on the device: every row samples, the live rows'
tokens and log-probs are written out, and the rows that just stopped (eos or a stop token,
their last allowed token) are marked. Which rows are live is read on the host (a sync) every
step on a CPU (nothing to overlap there) and every ``check_every`` (8) steps on a GPU, where
the loop otherwise never waits on the device: the loop ends when none is, and otherwise the
stopped rows leave the batch (:meth:`~aligner.generation.steppers.LeanStepper.compact`). The
eager step just stops computing them: their cache rows stay where they are, unread, each live
row writing its own; the live rows' cache is gathered together (a copy) only when the gaps
would cut the batch into more than 16 attention spans. Fixed-shape steps need the rows
together: they run at power-of-two batch sizes and halve when the live rows fit in half,
gathering the live rows' cache into the other half of its double buffer and padding with a
repeated row that writes nothing out, so a call captures a CUDA graph (sharing one memory pool)
or compiles a step at most ``log2(b)`` more times. Between checks a stopped row keeps stepping
at its last slot, its outputs dropped. Stop strings are looked for on the host every few steps
to stop rows early, and applied exactly at the end.

*Sampling* is one batched call per step (:func:`~aligner.generation.sampling.sample_next`).
The random numbers are drawn once per call, up front:
:func:`~aligner.generation.sampling.row_uniforms` ``[max_new_tokens, b]`` from the generator of
``(seed, data-parallel rank)``, prompt ``i``'s response token ``k`` drawn with element
``[k, i]``. What a row samples thus depends on the seed, its index and the batch size, never
on the other prompts, the sorting or the compaction, and the megatron backend and the no-cache
reference sample the same tokens from the same logits. (Step-major, the order in which a draw
per step consumed the generator before: a batch of equally long prompts samples, on a CPU,
exactly what it did then.)

*The megatron backend keeps teacher forcing* (what Megatron's static engine does; its
``StaticInferenceContext`` holds one sequence offset for the whole batch, so per-row positions
would mean rewriting its attention, and it is the reference, not the fast path):
:func:`~aligner.generation.steppers.teacher_forced_decode` prefills positions
``[0, min_prompt_len)`` and then feeds one position ``j`` per step to the whole batch, row
``i``'s own prompt token while ``j < prompt_len[i]`` (the token sampled for it is discarded),
its sampled token after; a row that has stopped keeps stepping until every row has.

*Two forward backends* (the steppers of :mod:`aligner.generation.steppers`):

- ``lean`` (default when the architecture allows): :class:`aligner.generation.decoder.LeanDecoder`,
  the same function as Megatron's forward in the fewest ops (plain linears on the module's
  weight tensors or the engine's own, RoPE on the new token only, attention by SDPA over a
  private cache kept across calls on a CPU), so log-probs equal the training forward's to
  round-off. On a GPU (TP=1) its decode step is captured in a CUDA graph, once per batch size
  of a call, and replayed for every position; on a CPU it can run compiled (``decode_step``).
- ``megatron``: ``GPTModel.forward`` with a ``StaticInferenceContext`` (sized exactly
  ``[T, b]``, one per call) and ``runtime_gather_output=True``; only the last position goes
  through the LM head (``materialize_only_last_token_logits``). It re-applies RoPE to the whole
  cached prefix at every step and pays Megatron's per-layer Python, so it is 2-3x slower on a
  CPU, and more on ragged batches (teacher forcing); it is the reference for the lean path and
  the fallback for other architectures, in the training layout only.

*Layouts.* The engine generates in its generation layout
(:class:`~aligner.generation.layout.GenerationLayout`): tensor parallel over ``generation_tp``
ranks (default: the training TP), the whole model on each generation group, whatever the
training layout. When that layout is the training one (PP=1, the same TP size) and the dtype is
the policy's, the engine generates with the training module itself and holds no copy of the
weights: a refit only rebinds the module, and the lean backend re-reads the parameter tensors
at the start of every call. A policy with LoRA adapters (:mod:`aligner.models.lora`) is the
exception: the lean backend then owns merged weights (``W + (alpha / r) * B @ A``, from the
weight stream) in any layout, refitted at every refit. Otherwise the engine owns its weights in
the generation layout and dtype (:class:`~aligner.generation.weights.OwnedWeights`, lean backend
only), allocated once, and every :meth:`NativeEngine.refit` streams the policy's full tensors out of the training
layout (:func:`aligner.models.layout.iter_megatron_tensors`, collective over the world) and
copies this rank's shard of each into them in place. So a policy trained pipeline parallel, or
at another TP size, generates at TP=``g`` (PP folded into TP, or TP=1 on every rank for a tiny
model), and a policy trained in fp32 can generate in bf16. :attr:`NativeEngine.last_refit`
holds the last refit's cost (seconds, bytes copied into the engine on this rank).

*Tensor parallelism.* Logits are gathered over the generation TP group, so every rank of it
holds the same full distribution; each samples with a generator seeded from ``(seed,
data-parallel rank)`` only, so every rank of a data-parallel replica (every generation group of
it) picks the same tokens with no per-step collective. With ``seed=None``, the replica's first
rank draws the seed and broadcasts it over the replica once per call.

*Padded vocabulary.* Logit columns beyond the real ``vocab_size`` (Megatron pads the
embedding for TP divisibility) are dropped before sampling and before the log-softmax.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from aligner.generation.decoder import LeanDecoder
from aligner.generation.engine import DECODE_STEPS, GenerationOutput, SamplingParams, engine_stop_ids
from aligner.generation.layout import GenerationLayout
from aligner.generation.policy import EvalMode, model_vocab
from aligner.generation.ragged import ragged_decode, ragged_length
from aligner.generation.sampling import build_output, check_prompts, rank_generator, row_uniforms
from aligner.generation.steppers import COMPILED_BUCKET, LeanStepper, MegatronStepper, teacher_forced_decode
from aligner.generation.weights import OwnedWeights
from aligner.models.fused import compile_available
from aligner.models.gpt import unwrap
from aligner.models.layout import iter_megatron_tensors
from aligner.models.local_spec import unsupported_reason
from aligner.models.lora import lora_config_of
from aligner.models.model_files import as_dtype

__all__ = ["NativeEngine", "RefitCost", "ENGINE_DTYPES", "WEIGHTS"]

#: The dtypes an engine generates in, by the names configs use.
ENGINE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: Where an engine's weights come from (``NativeEngine(weights=...)``).
WEIGHTS = ("auto", "owned", "shared")


def _resolve_ids(tokenizer, pad_id: int | None, eos_id: int | None) -> tuple[int, int]:
    if pad_id is None:
        pad_id = getattr(tokenizer, "pad_id", None)
    if eos_id is None:
        eos_id = getattr(tokenizer, "eos_id", None)
    if pad_id is None or eos_id is None:
        raise ValueError("pad_id and eos_id are required (or a tokenizer that has them)")
    return int(pad_id), int(eos_id)


@dataclass(frozen=True)
class RefitCost:
    """What the last :meth:`NativeEngine.refit` cost on this rank."""

    seconds: float
    """Wall time of the refit (for owned weights: the whole stream, collectives included)."""
    bytes: int
    """Bytes copied into the engine's own tensors on this rank (0 when it shares the module)."""
    stream_bytes: int = 0
    """Bytes of the full tensors that came through the weight stream on this rank."""
    owned: bool = False
    """Whether the engine owns its weights (False: zero-copy, the training module itself)."""

    @property
    def mbytes(self) -> float:
        """``bytes`` in MB (10^6 bytes)."""
        return self.bytes / 1e6


class NativeEngine:
    """KV-cache generation with the training policy's Megatron module, or with weights the
    engine owns in its own generation layout (see the module docstring, *Layouts*).

    Args:
        model: the policy (``GPTModel``, possibly inside DDP/Float16Module wrappers), built on
            this rank's TP shard and pipeline stage.
        tokenizer: needed for ``stop_strings``; also supplies pad/eos ids when not given.
        pad_id: written after each sample's end.
        eos_id: ends a sample (kept as its last token).
        stop_ids: more ids that end every sample (None: the tokenizer's ``stop_ids`` when
            ``eos_id`` is the tokenizer's: :func:`~aligner.generation.engine.engine_stop_ids`).
        max_seq_len: longest prompt + response; default ``model.aligner_config.max_seq_len``.
        parallel_state: :class:`aligner.distributed.ParallelState` (the training layout and
            the data-parallel rank); None means Megatron's parallel state, or a single process.
        vocab_size: real vocabulary (logit columns beyond it are never sampled); default
            ``model.aligner_config.vocab_size``, else the tokenizer's.
        check_every: steps between "which samples are still generating?" checks (a host sync,
            where the loop ends or compacts the batch); default 1 on CPU, 8 on GPU.
        backend: ``"lean"`` (:class:`~aligner.generation.decoder.LeanDecoder`: the fewest ops per
            step, a private KV cache), ``"megatron"`` (Megatron's own forward with a
            ``StaticInferenceContext``; the training layout only), or ``"auto"``: lean when the
            architecture is one it handles, else megatron.
        cpu_linear: lean backend, fp32 on a CPU: ``"auto"``/``"onednn"`` run the linear layers
            through oneDNN (about 2x MKL's fp32 GEMM on the project's AMD CPUs; same weight
            tensors), ``"default"`` uses ``F.linear``.
        decode_step: lean backend: ``"eager"`` (shapes follow the filled positions: fewest
            operations), ``"static"`` (fixed shapes, the positions as a tensor: what a CUDA graph
            replays, run eagerly), ``"graph"`` (static, captured in a CUDA graph once per batch
            size of a call; CUDA only), ``"compiled"`` (static under ``torch.compile``,
            generation TP=1, needs a C++ compiler on a CPU: about 1.5x the eager step's speed on
            a CPU; a step attends over a cache capacity that doubles from 64 positions as the
            sequence grows, the last one rounded up to a multiple of 64, so that few shapes
            compile; one compile per batch size of a call), or ``"auto"``:
            graph on a GPU with generation TP=1, eager elsewhere. A graph that fails to
            capture, or a step that fails to compile, falls back to eager with a warning.
        keep_cache: lean backend: keep the KV cache between calls (None: on a CPU yes, where a
            fresh buffer per call costs page faults; on a GPU no, where the memory is training's).
        num_threads: CPU threads while generating (restored afterwards); None leaves torch's
            setting. For a split actor/critic on one machine the critic is idle while the actor
            generates, so generation can take every core while training shares them.
        generation_tp: the generation tensor-parallel size ``g`` (None: the training TP); it
            must divide the training TP x PP (:class:`~aligner.generation.layout.GenerationLayout`).
            Constructing an engine whose generation groups differ from the training TP groups is
            collective over the world.
        dtype: the dtype the engine generates in (``torch.bfloat16``/``torch.float32`` or
            ``"bf16"``/``"fp32"``); None: the policy's dtype at each refit.
        weights: ``"auto"`` (share the training module's tensors when the generation layout and
            dtype are the training ones, else own a copy), ``"owned"`` (always own a copy,
            e.g. to measure a refit) or ``"shared"`` (always share; an error where that is
            impossible).

    :meth:`refit` is collective over the world when the engine owns its weights: every rank
    calls it, once after each policy update; :attr:`last_refit` is its :class:`RefitCost`.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer=None,
        *,
        pad_id: int | None = None,
        eos_id: int | None = None,
        stop_ids: Sequence[int] | None = None,
        max_seq_len: int | None = None,
        parallel_state=None,
        vocab_size: int | None = None,
        check_every: int | None = None,
        backend: str = "auto",
        cpu_linear: str = "auto",
        decode_step: str = "auto",
        keep_cache: bool | None = None,
        num_threads: int | None = None,
        generation_tp: int | None = None,
        dtype: torch.dtype | str | None = None,
        weights: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.pad_id, self.eos_id = _resolve_ids(tokenizer, pad_id, eos_id)
        self.stop_ids = engine_stop_ids(self.eos_id, tokenizer, stop_ids)
        self.parallel_state = parallel_state
        if backend not in ("auto", "lean", "megatron"):
            raise ValueError(f"backend={backend!r}: expected 'auto', 'lean' or 'megatron'")
        if cpu_linear not in ("auto", "onednn", "default"):
            raise ValueError(f"cpu_linear={cpu_linear!r}: expected 'auto', 'onednn' or 'default'")
        if check_every is not None and (not isinstance(check_every, int) or check_every < 1):
            raise ValueError(f"check_every={check_every!r}: expected an integer >= 1 or None")
        if decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step={decode_step!r}: expected one of {DECODE_STEPS}")
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise ValueError(f"num_threads={num_threads!r}: expected an integer >= 1 or None")
        if weights not in WEIGHTS:
            raise ValueError(f"weights={weights!r}: expected one of {list(WEIGHTS)}")
        if dtype is not None and as_dtype(dtype) not in ENGINE_DTYPES.values():
            raise ValueError(
                f"dtype={dtype!r}: expected one of {list(ENGINE_DTYPES)}, a torch dtype of them, or None"
            )
        self.backend = backend
        self.cpu_linear = cpu_linear
        self.decode_step = decode_step
        self.keep_cache = keep_cache
        self.num_threads = num_threads
        self.weights = weights
        self.dtype = as_dtype(dtype)
        self.layout = GenerationLayout.create(parallel_state, generation_tp)
        built_tp = int(getattr(getattr(unwrap(model), "config", None), "tensor_model_parallel_size", 1) or 1)
        if built_tp != self.layout.train_tp:
            raise ValueError(
                f"the model is built at tensor_model_parallel_size {built_tp}, but the parallel state says "
                f"{self.layout.train_tp}: pass parallel_state= (or initialise Megatron's parallel state)"
            )
        self._lean: LeanDecoder | None = None
        self._owned: OwnedWeights | None = None
        self.last_refit: RefitCost | None = None
        self.seed_rank: int | None = None
        """The data-parallel rank whose random streams a seeded :meth:`generate` draws from (None:
        this engine's own): a rollout worker generates each trainer rank's rows as that rank's own
        engine would."""
        self.model: nn.Module
        self.refit(model)
        if max_seq_len is None:
            cfg = getattr(self.model, "aligner_config", None)
            if cfg is None:
                raise ValueError("max_seq_len is required for a model without aligner_config")
            max_seq_len = int(cfg.max_seq_len)
        self.max_seq_len = int(max_seq_len)
        self.vocab_size = model_vocab(self.model, vocab_size, tokenizer)
        self.check_every = check_every

    # -- protocol -------------------------------------------------------------------------

    @property
    def owns_weights(self) -> bool:
        """Whether the engine generates with its own copy of the weights (else the module's)."""
        return self._owned is not None

    def refit(self, policy: nn.Module) -> None:
        """Generate with ``policy``'s current weights from now on.

        Zero-copy (the generation layout and dtype are the training ones): the engine just holds
        the module. Owned weights: the policy's full tensors are streamed out of the training
        layout and this rank's shard of each is copied into the engine's tensors, in place;
        collective over the world (every rank calls it). The cost is kept in :attr:`last_refit`.
        """
        t0 = time.perf_counter()
        model = unwrap(policy)
        some = next(model.parameters())
        if self._shares(model, some.dtype):
            if self._owned is not None:
                self._drop_owned()
            self.model, self._device = model, some.device
            self.last_refit = RefitCost(time.perf_counter() - t0, 0)
            return
        if self.backend == "megatron":
            raise ValueError(
                f"backend='megatron' generates with the training module in the training layout; this "
                f"engine owns its weights (generation_tp={self.layout.size}, training TP "
                f"{self.layout.train_tp} x PP {self.layout.train_pp}, dtype {self.dtype or some.dtype}, "
                f"weights={self.weights!r}): use backend 'lean' or 'auto'"
            )
        dtype = self.dtype or some.dtype
        owned = self._owned
        if (
            owned is None
            or owned.dtype != dtype
            or owned.device != some.device
            or owned.architecture_diff(model)
        ):
            if owned is not None:
                self._drop_owned()
            self._owned = OwnedWeights(model, self.layout.parallel_layout(), dtype, some.device)
        moved, seen = self._owned.load(iter_megatron_tensors(model, dtype=dtype))
        if some.device.type == "cuda":
            torch.cuda.synchronize(some.device)  # the copies are done when the time is taken
        self.model, self._device = model, some.device
        self.last_refit = RefitCost(time.perf_counter() - t0, moved, seen, owned=True)

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        between_steps: Callable[[int], bool] | None = None,
    ) -> GenerationOutput:
        """``between_steps(k)``: called before the decode step that computes every row's response
        token ``k`` (k >= 1), on the lean decoder only; it may write new weights into the module
        this engine generates from (in place, e.g. a pushed version), returning True when it did:
        the next steps read them, the KV cache of the tokens before is kept (partial rollouts)."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("sampling.stop_strings needs a tokenizer: pass tokenizer= to NativeEngine")
        prompts = check_prompts(prompts, self.max_seq_len, self.vocab_size)
        generator = None if sampling.greedy else self._generator(sampling.seed)
        with EvalMode(self.model), torch.inference_mode(), _Threads(self.num_threads):
            uniforms = row_uniforms(generator, len(prompts), sampling.max_new_tokens, self._device)
            hook = None if between_steps is None else self._swapping(between_steps)
            tokens, lengths, logprobs, ended, plen = self._decode(prompts, sampling, uniforms, hook)
        out = build_output(
            tokens, plen, lengths, logprobs, ended, self.pad_id, self.tokenizer, sampling.stop_strings
        )
        return self.layout.share(out)

    # -- internals ------------------------------------------------------------------------

    def _swapping(self, between_steps: Callable[[int], bool]) -> Callable[[int], None]:
        """``between_steps`` for the decode loop: weights it wrote into the module reach owned
        weights too (copied in place: the decoder's bound tensors stay the same)."""

        def hook(k: int) -> None:
            if between_steps(k) and self._owned is not None:
                self._owned.load(iter_megatron_tensors(self.model, dtype=self._owned.dtype))

        return hook

    def _shares(self, model: nn.Module, dtype: torch.dtype) -> bool:
        """Whether to generate with ``model``'s own tensors (else with owned weights)."""
        whole = getattr(model, "pre_process", True) and getattr(model, "post_process", True)
        can = self.layout.same_as_training and whole and self.dtype in (None, dtype)
        # LoRA: the lean decoder reads the weights, which are not the merged ones; the engine owns
        # a merged copy, refitted from the weight stream. Megatron's forward runs the adapters.
        lora = lora_config_of(model) is not None and self.backend != "megatron"
        if self.weights == "shared" and (lora or not can):
            raise ValueError(
                "weights='shared': the policy has LoRA adapters, so the engine generates with merged weights "
                "of its own: use weights='auto' (or backend='megatron')"
                if lora
                else f"weights='shared': the engine can share the training module's tensors only in the "
                f"training layout (PP=1 and generation_tp = training TP) and dtype; here generation_tp="
                f"{self.layout.size}, training TP {self.layout.train_tp} x PP {self.layout.train_pp}, dtype "
                f"{self.dtype} vs the policy's {dtype}: use weights='auto'"
            )
        return can and not lora and self.weights != "owned"

    def _drop_owned(self) -> None:
        if self._lean is not None:
            self._lean.release()
        self._lean = None
        self._owned = None

    def _generator(self, seed: int | None) -> torch.Generator:
        lay = self.layout
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
            group = lay.replica_group
            if group is not None and dist.get_world_size(group) > 1:
                # Every rank of the replica must sample the same tokens: its first rank's draw wins.
                t = torch.tensor([seed], dtype=torch.int64, device=self._device)
                dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
                seed = int(t.item())
        return rank_generator(seed, lay.dp_rank if self.seed_rank is None else self.seed_rank, self._device)

    def _stepper(self, b: int, T: int, lean: bool):
        if lean:
            mode = self._lean_decode_step()
            if mode == "compiled":
                T = min(self.max_seq_len, -(-T // COMPILED_BUCKET) * COMPILED_BUCKET)
            return LeanStepper(self._lean, b, T, mode)
        return MegatronStepper(self.model, b, T)

    def _lean_decode_step(self) -> str:
        mode = self.decode_step
        on_cuda = self._device.type == "cuda"
        if mode == "auto":
            return "graph" if on_cuda and self._lean.tp_size == 1 else "eager"
        if mode == "graph" and not on_cuda:
            raise ValueError(f"decode_step='graph' needs a CUDA device; the model is on {self._device}")
        if mode == "compiled":
            if self._lean.tp_size > 1:
                raise ValueError(
                    "decode_step='compiled' needs generation tensor_parallel_size 1 "
                    f"(got {self._lean.tp_size}); use 'eager'"
                )
            why = compile_available() if not on_cuda else None
            if why is not None:
                raise ValueError(f"decode_step='compiled' is not available: {why}")
        return mode

    def _use_lean(self) -> bool:
        lay = self.layout
        if self._owned is not None:
            if self._lean is None or self._lean.source is not self._owned:
                if self._lean is not None:
                    self._lean.release()
                self._lean = LeanDecoder(
                    self._owned, lay.group, lay.size, cpu_linear=self.cpu_linear, keep_cache=self.keep_cache
                )
            return True
        if self.backend == "megatron":
            return False
        if self._lean is None or self._lean.model is not self.model:
            reason = unsupported_reason(self.model)
            if reason is not None:
                if self.backend == "lean":
                    raise ValueError(f"backend='lean' cannot run this model: {reason}")
                self._lean = None
                return False
            if self._lean is not None:
                self._lean.release()
            self._lean = LeanDecoder(
                self.model, lay.group, lay.size, cpu_linear=self.cpu_linear, keep_cache=self.keep_cache
            )
        return True

    def _decode(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        uniforms: torch.Tensor | None,
        between_steps: Callable[[int], None] | None = None,
    ):
        """The lean backend's ragged loop or the megatron backend's teacher-forced one (module
        docstring, *Design*). ``uniforms``: ``[max_new_tokens, b]`` (None: greedy). Returns
        ``(tokens [b, T], lengths [b], logprobs [b, T-1], ended [b], prompt_lengths [b])`` for
        :func:`~aligner.generation.sampling.build_output`."""
        dev = self._device
        stop_ids = torch.tensor(
            sorted({*self.stop_ids, *sampling.stop_token_ids}), dtype=torch.int64, device=dev
        )
        check_every = self.check_every or (1 if dev.type == "cpu" else 8)
        lean = self._use_lean()
        if between_steps is not None and not lean:
            raise ValueError(
                "a swap between decode steps (partial rollouts) needs the lean decoder: this model runs "
                f"on the megatron backend ({unsupported_reason(self.model) or 'backend=megatron'})"
            )
        plen = [len(p) for p in prompts]
        if lean:
            T = ragged_length(plen, sampling.max_new_tokens, self.max_seq_len)
        else:
            T = min(self.max_seq_len, max(plen) + sampling.max_new_tokens)
        step = self._stepper(len(prompts), T, lean)
        try:
            if lean:
                return ragged_decode(
                    step,
                    prompts,
                    sampling,
                    uniforms,
                    vocab_size=self.vocab_size,
                    pad_id=self.pad_id,
                    stop_ids=stop_ids,
                    max_seq_len=self.max_seq_len,
                    check_every=check_every,
                    tokenizer=self.tokenizer,
                    between_steps=between_steps,
                )
            return teacher_forced_decode(
                step,
                prompts,
                sampling,
                uniforms,
                T=T,
                vocab_size=self.vocab_size,
                pad_id=self.pad_id,
                stop_ids=stop_ids,
                check_every=check_every,
                tokenizer=self.tokenizer,
            )
        finally:
            if getattr(step, "step_failed", False):
                self.decode_step = "eager"  # warned once; do not retry every call
            step.close()


class _Threads:
    """Set torch's CPU thread count for a block and restore it (None: leave it alone)."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        self.saved = torch.get_num_threads()
        if self.n is not None and self.n != self.saved:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        if torch.get_num_threads() != self.saved:
            torch.set_num_threads(self.saved)

"""The native engine: KV-cache decoding on the training policy's Megatron-core module, or on
weights it owns in a generation layout of its own.

Design
------
*Prefill, then teacher-forced decode* (what Megatron's static engine does). The batch's
prompts are written, right-padded, into one token buffer ``[b, T]`` with
``T = min(max_seq_len, longest prompt + max_new_tokens)``. The first forward encodes
positions ``[0, min_prompt_len)`` of every row at once into the KV cache; after that every
step feeds one position ``j`` for the whole batch: row ``i``'s own prompt token while
``j < prompt_len[i]`` (the token sampled for it is discarded: teacher forcing), its sampled
token once ``j >= prompt_len[i]``. Every row therefore attends to exactly its own prefix:
no left padding, no attention mask, no per-row position offsets, and the result equals
decoding each prompt on its own (the tests check this against a full recompute and against
one-prompt batches). A row that has stopped keeps stepping (its outputs are ignored, its
tokens are pad) until all rows have stopped: the "all done?" check is a host sync, made every
step on a CPU (nothing to overlap there) and every ``check_every`` (8) steps on a GPU, where
the loop otherwise never waits on the device. Stop strings are checked on the host every few
steps to stop early, and applied exactly at the end. Sampling is one batched call per step
for the whole batch (:func:`~aligner.generation.sampling.sample_next`).

*Two forward backends* (the steppers of :mod:`aligner.generation.steppers`):

- ``lean`` (default when the architecture allows): :class:`aligner.generation.decoder.LeanDecoder`,
  the same function as Megatron's forward in the fewest ops (plain linears on the module's
  weight tensors or the engine's own, RoPE on the new token only, attention by SDPA over a
  private cache kept across calls on a CPU), so log-probs equal the training forward's to
  round-off. On a GPU (TP=1) its decode step is captured once per call in a CUDA graph and
  replayed for every position; on a CPU it can run compiled (``decode_step``).
- ``megatron``: ``GPTModel.forward`` with a ``StaticInferenceContext`` (sized exactly
  ``[T, b]``, one per call) and ``runtime_gather_output=True``; only the last position goes
  through the LM head (``materialize_only_last_token_logits``). It re-applies RoPE to the whole
  cached prefix at every step and pays Megatron's per-layer Python, so it is 2-3x slower on a
  CPU; it is the reference for the lean path and the fallback for other architectures, in
  the training layout only.

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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from aligner.generation.decoder import LeanDecoder
from aligner.generation.engine import DECODE_STEPS, GenerationOutput, SamplingParams
from aligner.generation.layout import GenerationLayout
from aligner.generation.policy import EvalMode, model_vocab
from aligner.generation.sampling import build_output, check_prompts, rank_generator, sample_next
from aligner.generation.steppers import COMPILED_BUCKET, LeanStepper, MegatronStepper
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
        max_seq_len: longest prompt + response; default ``model.aligner_config.max_seq_len``.
        parallel_state: :class:`aligner.distributed.ParallelState` (the training layout and
            the data-parallel rank); None means Megatron's parallel state, or a single process.
        vocab_size: real vocabulary (logit columns beyond it are never sampled); default
            ``model.aligner_config.vocab_size``, else the tokenizer's.
        check_every: steps between "have all samples stopped?" checks (a host sync);
            default 1 on CPU, 8 on GPU.
        backend: ``"lean"`` (:class:`~aligner.generation.decoder.LeanDecoder`: the fewest ops per
            step, a private KV cache), ``"megatron"`` (Megatron's own forward with a
            ``StaticInferenceContext``; the training layout only), or ``"auto"``: lean when the
            architecture is one it handles, else megatron.
        cpu_linear: lean backend, fp32 on a CPU: ``"auto"``/``"onednn"`` run the linear layers
            through oneDNN (about 2x MKL's fp32 GEMM on the project's AMD CPUs; same weight
            tensors), ``"default"`` uses ``F.linear``.
        decode_step: lean backend: ``"eager"`` (shapes follow the filled positions: fewest
            operations), ``"static"`` (fixed shapes, the position as a tensor: what a CUDA graph
            replays, run eagerly), ``"graph"`` (static, captured in a CUDA graph once per call;
            CUDA only), ``"compiled"`` (static under ``torch.compile``, generation TP=1, needs a
            C++ compiler on a CPU: about 1.5x the eager step's speed on a CPU; a step attends
            over a cache capacity that doubles from 64 positions as the sequence grows, the last
            one rounded up to a multiple of 64, so that few shapes compile), or ``"auto"``:
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

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("sampling.stop_strings needs a tokenizer: pass tokenizer= to NativeEngine")
        prompts = check_prompts(prompts, self.max_seq_len, self.vocab_size)
        prompt_lens = [len(p) for p in prompts]
        generator = None if sampling.greedy else self._generator(sampling.seed)
        with EvalMode(self.model), torch.inference_mode(), _Threads(self.num_threads):
            tokens, lengths, logprobs, ended, plen = self._decode(prompts, prompt_lens, sampling, generator)
        out = build_output(
            tokens, plen, lengths, logprobs, ended, self.pad_id, self.tokenizer, sampling.stop_strings
        )
        return self.layout.share(out)

    # -- internals ------------------------------------------------------------------------

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
        return rank_generator(seed, lay.dp_rank, self._device)

    def _stepper(self, b: int, T: int):
        if self._use_lean():
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
        prompts: Sequence[Sequence[int]],
        prompt_lens: list[int],
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ):
        dev = self._device
        b = len(prompts)
        min_p, max_p = min(prompt_lens), max(prompt_lens)
        T = min(self.max_seq_len, max_p + sampling.max_new_tokens)
        pad = self.pad_id

        rows = [p + [pad] * (T - len(p)) for p in prompts]
        buf = torch.tensor(rows, dtype=torch.int64, device=dev)  # [b, T]
        plen = torch.tensor(prompt_lens, dtype=torch.int64, device=dev)
        positions = torch.arange(T, device=dev).unsqueeze(0).expand(b, T)
        # gen[i, j]: row i samples its token j (prompt_len <= j < prompt_len + max_new).
        gen = (positions >= plen.unsqueeze(1)) & (positions < (plen + sampling.max_new_tokens).unsqueeze(1))
        gen_t = gen.t().contiguous()  # [T, b]: one contiguous row per step
        stop_ids = torch.tensor(
            sorted({self.eos_id, *sampling.stop_token_ids}), dtype=torch.int64, device=dev
        )
        # Last position each row can fill.
        row_last = (plen + sampling.max_new_tokens).clamp(max=T) - 1
        check_every = self.check_every or (1 if dev.type == "cpu" else 8)

        step = self._stepper(b, T)
        if getattr(step, "step_failed", False):
            self.decode_step = "eager"  # warned once; do not retry every call
        try:
            return self._loop(
                step, buf, plen, gen_t, row_last, stop_ids, sampling, generator, min_p, check_every
            )
        finally:
            step.close()

    def _loop(self, step, buf, plen, gen_t, row_last, stop_ids, sampling, generator, min_p, check_every):
        b, T = buf.shape
        V = self.vocab_size
        logprobs = torch.zeros(b, T - 1, dtype=torch.float32, device=buf.device)
        done = torch.zeros(b, dtype=torch.bool, device=buf.device)  # stopped by eos / stop token
        n_gen = torch.zeros(b, dtype=torch.int64, device=buf.device)
        last_j = int(row_last.max())
        trim = V is not None
        stop_every = max(check_every, 4)
        logits = step(buf[:, :min_p], 0)
        for j in range(min_p, last_j + 1):
            # Sample token j of every row from the logits of position j-1.
            z = (logits[:, :V] if trim else logits).float()
            tok, lp = sample_next(z, sampling, generator)
            active = gen_t[j] & ~done
            buf[:, j] = torch.where(active, tok, buf[:, j])
            logprobs[:, j - 1] = torch.where(active, lp, 0.0)
            n_gen += active
            done |= active & torch.isin(tok, stop_ids)
            if j == last_j:
                break
            k = j - min_p + 1  # steps taken
            if sampling.stop_strings and k % stop_every == 0:
                # Decoding on the host is costly: look every few steps. Rows found here stop
                # generating; build_output cuts each exactly after its stop string.
                done |= self._stop_string_hits(buf, plen, n_gen, done, sampling.stop_strings)
            if k % check_every == 0 and bool((done | (row_last <= j)).all()):
                break  # every row stopped or at its last position
            logits = step(buf[:, j : j + 1], j)
        # Rows that stopped hold pad after their end already; build_output pads and trims.
        return buf, plen + n_gen, logprobs, done, plen

    def _stop_string_hits(self, buf, plen, n_gen, done, stop_strings) -> torch.Tensor:
        hits = torch.zeros_like(done)
        rows = buf.tolist()
        for i, (row, p, n, d) in enumerate(zip(rows, plen.tolist(), n_gen.tolist(), done.tolist())):
            if d or n == 0:
                continue
            text = self.tokenizer.decode(row[p : p + n])
            if any(s in text for s in stop_strings):
                hits[i] = True
        return hits


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

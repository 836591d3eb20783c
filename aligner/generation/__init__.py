"""Generation engines and what they share.

- :mod:`~aligner.generation.engine`: the protocol (:class:`GenerationEngine`), its inputs and
  outputs (:class:`SamplingParams`, :class:`GenerationOutput`);
- :mod:`~aligner.generation.native`: :class:`NativeEngine`, KV-cache decoding on the training
  policy's Megatron-core module or on weights it owns in a generation layout of its own
  (:mod:`~aligner.generation.layout`, :mod:`~aligner.generation.weights`), through one of the
  forward backends of :mod:`~aligner.generation.steppers`: the KV-cache decoder of
  :mod:`~aligner.generation.decoder` (its fixed-shape step captured or compiled in
  :mod:`~aligner.generation.decode_steps`, driven over ragged batches by
  :mod:`~aligner.generation.ragged`) or Megatron's own forward;
- :mod:`~aligner.generation.trtllm`: the TensorRT-LLM engine (a package; importing it never
  imports ``tensorrt_llm``);
- :mod:`~aligner.generation.no_cache`: :func:`generate_no_cache`, the reference by full recompute;
- :mod:`~aligner.generation.sampling` and :mod:`~aligner.generation.policy`: sampling, prompt
  checks and output building, and the policy module as the generation paths read it;
- :mod:`~aligner.generation.config`: the ``generation`` section of the actor's config.
"""

from aligner.generation.engine import GenerationEngine, GenerationOutput, SamplingParams
from aligner.generation.layout import GenerationLayout
from aligner.generation.native import NativeEngine, RefitCost
from aligner.generation.no_cache import generate_no_cache

__all__ = [
    "GenerationEngine",
    "GenerationOutput",
    "SamplingParams",
    "GenerationLayout",
    "NativeEngine",
    "RefitCost",
    "generate_no_cache",
]

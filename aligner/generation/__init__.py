"""Generation engines: the protocol, the native Megatron KV-cache engine (in the training layout
or a generation layout of its own), the reference."""

from aligner.generation.engine import GenerationEngine, GenerationOutput, SamplingParams
from aligner.generation.layout import GenerationLayout
from aligner.generation.native import NativeEngine, RefitCost, generate_no_cache

__all__ = [
    "GenerationEngine",
    "GenerationOutput",
    "SamplingParams",
    "GenerationLayout",
    "NativeEngine",
    "RefitCost",
    "generate_no_cache",
]

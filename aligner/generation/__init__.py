"""Generation engines: the protocol, the native Megatron KV-cache engine, the reference."""

from aligner.generation.engine import GenerationEngine, GenerationOutput, SamplingParams
from aligner.generation.native import NativeEngine, generate_no_cache

__all__ = ["GenerationEngine", "GenerationOutput", "SamplingParams", "NativeEngine", "generate_no_cache"]

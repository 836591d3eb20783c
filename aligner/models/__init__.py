"""Megatron-core GPT models (policy, critic, reward model) and HF checkpoint conversion.

Modules, each importing only those listed before it:

- :mod:`~aligner.models.config`: :class:`ModelConfig` and the package's errors;
- :mod:`~aligner.models.rope`: RoPE (its frequencies, llama3-scaled or not, and its tables in
  Megatron's rounding);
- :mod:`~aligner.models.attention`: attention by SDPA (causal, grouped-query, masked rows), for
  the fused forward and the lean decoder;
- :mod:`~aligner.models.gpt`: the builders of the three roles' models, their heads and configs;
- :mod:`~aligner.models.lora`: LoRA adapters on a built model, their arithmetic and the merged
  weights;
- :mod:`~aligner.models.packing`: rows laid end to end without padding (positions restarting
  per row) and micro-batch plans bounded by a token budget;
- :mod:`~aligner.models.local_spec`, :mod:`~aligner.models.fused`: which models a forward over
  a model's own parameters (the fused one, and :mod:`aligner.generation.decoder`'s) reproduces,
  and the fused forward itself;
- :mod:`~aligner.models.forward`: the forwards (logits, values, scores), Megatron's or fused;
- :mod:`~aligner.models.model_files`: safetensors written as a stream, the atomic output folder;
- :mod:`~aligner.models.layout`: the canonical tensors, their TP/PP layout and the weight stream;
- :mod:`~aligner.models.hf_config`, :mod:`~aligner.models.hf_names`, :mod:`~aligner.models.hf`:
  HF configs, HF tensor names, and HF export/import;
- :mod:`~aligner.models.lora_io`: the adapters at their full shapes, gathered, sharded, saved
  and exported for peft;
- :mod:`~aligner.models.checkpoint_io`: our own checkpoint format;
  :mod:`~aligner.models.convert_cli` is the ``aligner-convert`` command.
"""

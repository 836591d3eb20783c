"""Megatron-core GPT models (policy, critic, reward model) and HF checkpoint conversion.

- :mod:`~aligner.models.config`: :class:`ModelConfig` and the package's errors;
- :mod:`~aligner.models.gpt`: the builders of the three roles' models and their forwards;
- :mod:`~aligner.models.fused`, :mod:`~aligner.models.local_spec`, :mod:`~aligner.models.rope`:
  the fused forward over a model's own parameters, which models it (and the lean decoder)
  reproduces exactly, and RoPE (its frequencies, llama3-scaled or not, and its tables in
  Megatron's rounding);
- :mod:`~aligner.models.layout`: the canonical tensors, their TP/PP layout and the weight stream;
- :mod:`~aligner.models.model_files`: safetensors written as a stream, the atomic output folder;
- :mod:`~aligner.models.checkpoint_io`: our own checkpoint format;
- :mod:`~aligner.models.hf_config`, :mod:`~aligner.models.hf_names`, :mod:`~aligner.models.hf`:
  HF configs, HF tensor names, and HF export/import; :mod:`~aligner.models.convert_cli` is the
  ``aligner-convert`` command.
"""

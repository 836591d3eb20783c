"""The TensorRT-LLM engine: TensorRT-LLM's LLM API (PyTorch backend, Ray orchestrator) behind the
:class:`~aligner.generation.engine.GenerationEngine` protocol (``generation.engine: trtllm``).

Target: TensorRT-LLM **1.2.1** (:data:`TRTLLM_VERSION`, NVIDIA's release image
``nvcr.io/nvidia/tensorrt-llm/release:1.2.1``). The 1.2 line is the first where the PyTorch
backend refits in place through a public path (the Ray orchestrator and its RLHF worker
extension: "New Ray orchestrator type" in the 1.2 release notes; 1.0 and 1.1 have no refit or
sleep for the PyTorch backend), and 1.2.1 is the newest patch release of that line. Later lines
renamed what this package relies on (the sleep switch became ``sleep_config``, the memory tags
became ``ExecutorMemoryType`` members with other names), so :func:`load_llm_api` refuses any
other release line rather than run against an API this code was not written for.

How it works (docs/design.md, "Generation engines"; docs/trtllm.md):

- **Build.** ``LLM(model=<HF folder>, load_format="dummy", skip_tokenizer_init=True,
  orchestrator_type="ray", ray_worker_extension_cls=WorkerExtension, ...)``: the folder needs only
  ``config.json`` (dummy weights; requests are token ids, so no tokenizer), written from the
  policy's :class:`~aligner.models.config.ModelConfig` by
  :func:`~aligner.generation.trtllm.handles.write_hf_config_dir` unless
  ``generation.trtllm.hf_config_dir`` names one. The engine holds its own copy of the weights.
- **Refit.** Every rank iterates :func:`aligner.models.hf.iter_hf_tensors` (collective over TP and
  PP: full tensors under HF names, the engine shards them itself), grouped into buckets of
  ``bucket_mb`` (:func:`aligner.models.layout.bucketed`). Each bucket becomes CUDA IPC handles keyed
  by the sending GPU's UUID (:func:`~aligner.generation.trtllm.handles.ipc_handles`); the engine's
  owner sends them through the worker extension's ``update_weights``, then ``update_weights(None)``
  finalises the update (post-load hooks, prefix-cache reset). Each engine worker opens the handles
  of its own GPU.
- **Memory.** With ``sleep_during_training`` the engine is built with ``enable_sleep=True``; it
  wakes its weights before a refit and its KV cache before generating, and puts everything to sleep
  again after each ``generate`` (training follows), so training has the GPU memory.
- **Requests.** One TensorRT-LLM ``SamplingParams`` per prompt: ``max_tokens`` always set (the
  library's default is 32), eos and the stop tokens as ``stop_token_ids`` with ``end_id=-1`` and
  ``include_stop_str_in_output=True`` so the stop token stays in the response, ids the policy never
  samples as ``bad_token_ids``, ``logprobs=1``, and an explicit ``seed`` per request
  (:func:`~aligner.generation.trtllm.requests.request_seed`) for the C++ ``TRTLLMSampler``, which
  honours per-request seeds.
- **Outputs.** :func:`~aligner.generation.trtllm.outputs.read_completion` takes each generated
  token's log-probability by the sampled id (``logprobs[j][token_ids[j]].logprob``) and checks that
  the stop token was kept; :func:`~aligner.generation.trtllm.outputs.completions_to_output` writes
  the project's tensor conventions through :func:`~aligner.generation.sampling.build_output`. The
  log-probabilities are TensorRT-LLM's own: the trainer recomputes them with the training forward
  and logs the difference (``rollout/logprob_mismatch_*``).
- **Ranks.** An engine spans ``tensor_parallel_size`` GPUs. Its ``group`` is the process group of
  the ranks on those GPUs (all holding the same prompts: the same data-parallel rank, e.g. a
  tensor-parallel group); group rank 0 owns the ``LLM`` object, every member sends the handles of
  its own GPU, and the owner broadcasts each generation to the others. ``group=None``: this process
  alone, generation TP 1.

The modules: :mod:`~aligner.generation.trtllm.config` (the settings),
:mod:`~aligner.generation.trtllm.boundary` (the release, the import of the LLM API, the error),
:mod:`~aligner.generation.trtllm.requests` (the ``LLM`` and ``SamplingParams`` arguments),
:mod:`~aligner.generation.trtllm.outputs` (the completions read back),
:mod:`~aligner.generation.trtllm.handles` (IPC handles, the HF config folder) and
:mod:`~aligner.generation.trtllm.engine` (:class:`TrtllmEngine`).

Importing this package (any of its modules) never imports ``tensorrt_llm``: it is imported when an
engine is built, and where it is missing the error says where to get it (``Dockerfile.trtllm``).
"""

from aligner.generation.trtllm.boundary import (
    TRTLLM_IMAGE,
    TRTLLM_VERSION,
    LlmApi,
    TrtllmUnavailableError,
    load_llm_api,
    missing_package_message,
)
from aligner.generation.trtllm.config import TrtllmConfig
from aligner.generation.trtllm.engine import TrtllmEngine

__all__ = [
    "TRTLLM_VERSION",
    "TRTLLM_IMAGE",
    "TrtllmConfig",
    "TrtllmEngine",
    "TrtllmUnavailableError",
    "LlmApi",
    "load_llm_api",
    "missing_package_message",
]

"""The refit's pieces: the weights as CUDA IPC handles keyed by the sending GPU, the HF config folder
the engine is built from, and the gather of every rank's handles over the engine's group (the
package docstring, *Build* and *Refit*).
"""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.multiprocessing.reductions import reduce_tensor

from aligner.generation.trtllm.config import DTYPES
from aligner.models.config import ModelConfig
from aligner.models.hf_config import default_architecture as converter_default
from aligner.models.hf_config import hf_config_from_model_config

__all__ = [
    "ipc_handles",
    "local_device_uuid",
    "default_architecture",
    "write_hf_config_dir",
]


def ipc_handles(bucket: Sequence[tuple[str, torch.Tensor]], device_uuid: str) -> dict[str, str]:
    """``{device_uuid: payload}`` for the worker extension's ``update_weights``: the payload is a
    base64 string of a pickled list of ``(HF name, torch.multiprocessing reduce_tensor handle)``.

    The pickle is TensorRT-LLM's documented payload format (its worker reads it with a
    restricted unpickler and rebuilds each tensor on its own device); it is the only place the
    project pickles anything. The tensors must stay alive until the engine has loaded them.
    """
    handles = [(name, reduce_tensor(t.detach())) for name, t in bucket]
    return {device_uuid: base64.b64encode(pickle.dumps(handles)).decode("ascii")}


def local_device_uuid() -> str:
    """This process's CUDA device as TensorRT-LLM names it (``"GPU-" + uuid``), the key its
    worker on that GPU looks up in ``update_weights``."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "the TensorRT-LLM refit passes CUDA IPC handles of the policy's weights: it needs the "
            "policy on a CUDA device, and none is available"
        )
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return "GPU-" + str(props.uuid)


def default_architecture(cfg: ModelConfig) -> str:
    """The HF architecture a policy of ``cfg`` is exported as when none is configured (the
    converter's choice: Qwen3 for q/k norms, Qwen2 for q/k/v biases alone, GPT-2 for learned
    positions, else Llama)."""
    return converter_default(cfg)


def write_hf_config_dir(
    cfg: ModelConfig, arch: str, out_dir: str | os.PathLike, dtype: str = "bfloat16"
) -> Path:
    """Write the HF ``config.json`` of a ``cfg`` policy as ``arch`` into ``out_dir`` (the folder
    the engine is built from; no weights: it starts from dummy weights and is refitted). The
    file is replaced atomically, so ranks writing the same file at once are harmless."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {list(DTYPES)}")
    conf = hf_config_from_model_config(cfg, arch, dtype=DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(conf.to_json_string())
    os.replace(tmp, out / "config.json")
    return out

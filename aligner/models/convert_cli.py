"""``aligner-convert``: Hugging Face folders <-> our model checkpoints.

    aligner-convert import HF_DIR CKPT_DIR [--role policy|critic|reward] [--tp N --pp N]
    aligner-convert export CKPT_DIR HF_DIR [--arch LlamaForCausalLM] [--tokenizer DIR]
        [--base DIR] [--dtype bfloat16] [--max-shard-size 5GB|none] [--peft]

``export`` reads any of this project's checkpoints (:func:`aligner.models.export_source.find_export_source`):
a model checkpoint (``aligner-convert import``'s, or a training step's ``actor/policy``), an
actor training checkpoint (``<dir>/step_XXXXXXXX``, ``<dir>/best``, or ``<dir>`` itself for its
newest step), a LoRA run's included: its adapters are merged onto the run's base model
(``init_from``, or ``--base``), and ``--peft`` also writes them alone in peft's format
(``peft_adapter/``). The export keeps the base model's ``config.json`` fields (token ids, context
length, RoPE settings) and carries its tokenizer files, chat template and ``generation_config.json``;
a training checkpoint's export gets a model card (``README.md``) naming the run's settings and
its metrics at that step.

Our checkpoints hold full tensors, so one process (TP=1, PP=1, the default) converts any
model that fits in memory. ``--tp/--pp`` build the model on that layout instead (launch that
many processes with ``torchrun``); the result is the same files.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from aligner import distributed
from aligner.checkpoint import CheckpointError
from aligner.config_checks import ConfigError
from aligner.metrics import read_metrics
from aligner.models import checkpoint_io, gpt, hf
from aligner.models.config import ConversionError, ModelConfig
from aligner.models.export_source import ExportSource, find_export_source
from aligner.models.hf_config import default_architecture, hf_architecture, read_hf_config
from aligner.models.lora import LoraConfig, apply_lora
from aligner.models.lora_io import export_peft_adapter, load_lora_adapter
from aligner.models.model_card import model_card
from aligner.models.model_files import parse_size, read_json_object
from aligner.tokenizers import has_tokenizer_files

__all__ = ["main", "build_parser"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aligner-convert", description="Hugging Face folders <-> our model checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)

    def parallel(sp: argparse.ArgumentParser, dtype: str) -> None:
        sp.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build the model with")
        sp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to build the model with")
        sp.add_argument(
            "--dtype",
            choices=sorted(_DTYPES),
            default=dtype,
            help=f"dtype of the model while converting, and of the written tensors (default {dtype})",
        )
        sp.add_argument("--overwrite", action="store_true", help="replace the output folder if it exists")

    imp = sub.add_parser("import", help="HF folder -> our checkpoint folder")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--role", choices=("policy", "critic", "reward"), default="policy")
    imp.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=None,
        help="stored in the checkpoint's model config (the files hold the un-padded vocab)",
    )
    parallel(imp, "float32")

    exp = sub.add_parser(
        "export",
        help="our checkpoint folder -> HF folder: a model checkpoint, or an actor training checkpoint "
        "(<dir>/step_XXXXXXXX, <dir>/best, or <dir> for its newest step; LoRA runs merged)",
    )
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    exp.add_argument(
        "--arch",
        default=None,
        help="HF architecture or family (default: the one recorded at import, else the family the "
        "model's config fits: qwen3 for q/k norms, qwen2 for q/k/v biases, gpt2 for learned "
        "positions, llama)",
    )
    exp.add_argument(
        "--tokenizer",
        default=None,
        help="folder whose tokenizer files are copied alongside (default: the run's tokenizer folder, "
        "and the base model's files)",
    )
    exp.add_argument(
        "--base",
        default=None,
        help="the base model folder (HF or ours) whose config.json fields and files the export keeps, "
        "and onto which a LoRA checkpoint's adapters are merged (default: the run's init_from)",
    )
    exp.add_argument(
        "--max-shard-size",
        default="5GB",
        help="cut larger weights into shards of at most this size ('5GB', '500MB', bytes) with "
        "model.safetensors.index.json, as save_pretrained (default 5GB; 'none': one model.safetensors)",
    )
    exp.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint: also write its adapters alone in peft's format (peft_adapter/)",
    )
    parallel(exp, "bfloat16")
    return p


def _run(args: argparse.Namespace) -> None:
    dtype = _DTYPES[args.dtype]
    if args.command == "import":
        overrides = {}
        if args.make_vocab_size_divisible_by is not None:
            overrides["make_vocab_size_divisible_by"] = args.make_vocab_size_divisible_by
        # Everything is checked before any process group or model exists.
        hf.validate_hf_folder(args.hf_dir, args.role, args.tp, args.pp, **overrides)
    else:
        if str(args.max_shard_size).lower() == "none":
            args.max_shard_size = None
        parse_size(args.max_shard_size, "--max-shard-size")
        src = find_export_source(args.ckpt_dir)
        base = src.base(args.base)
        if src.lora_dir is not None:
            adapter = read_json_object(src.lora_dir / "adapter.json", "LoRA adapter")
            mc = ModelConfig.from_dict(adapter.get("model_config") or {})
        else:
            if args.peft:
                raise ConversionError(f"--peft: {args.ckpt_dir} holds no LoRA adapters")
            mc = checkpoint_io.read_checkpoint_meta(src.model_dir)["model_config"]
        mc.check_parallel(args.tp, args.pp)

    from megatron.core import parallel_state as mpu

    owned = not dist.is_initialized() and not mpu.model_parallel_is_initialized()
    if owned:
        distributed.initialize(
            distributed.ParallelConfig(
                tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
            )
        )
    elif (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()) != (
        args.tp,
        args.pp,
    ):
        raise ConversionError(
            f"the process is already set up for TP={mpu.get_tensor_model_parallel_world_size()}, "
            f"PP={mpu.get_pipeline_model_parallel_world_size()}, not --tp {args.tp} --pp {args.pp}"
        )
    try:
        if args.command == "import":
            model, cfg = hf.import_hf(args.hf_dir, args.role, params_dtype=dtype, **overrides)
            checkpoint_io.save_model_checkpoint(
                model,
                cfg,
                args.out_dir,
                args.role,
                hf_architecture=hf_architecture(args.hf_dir),
                hf_config=read_hf_config(args.hf_dir),
                dtype=dtype,
                overwrite=args.overwrite,
            )
        else:
            _export(args, src, base, mc, dtype)
    finally:
        if owned:
            distributed.destroy()


def _export(args: argparse.Namespace, src: ExportSource, base, cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Build the checkpoint's policy (a LoRA one: the base model's weights, the adapters applied and
    loaded) and write it as an HF folder."""
    if src.lora_dir is not None:
        adapter = read_json_object(src.lora_dir / "adapter.json", "LoRA adapter")
        model = gpt.build_policy(cfg, params_dtype=dtype)
        checkpoint_io.load_weights_from(model, cfg, base.path)
        apply_lora(model, LoraConfig(**adapter.get("lora", {})))
        load_lora_adapter(model, src.lora_dir)
    else:
        model, cfg, _ = checkpoint_io.build_from_checkpoint(src.model_dir, params_dtype=dtype)
    run_cfg = src.config
    export_arch = (run_cfg.get("checkpoint") or {}).get("export_arch")
    arch = args.arch or export_arch or base.architecture or default_architecture(cfg)
    tok = args.tokenizer
    recorded = run_cfg.get("tokenizer")
    if tok is None and isinstance(recorded, str) and os.path.isdir(recorded):
        tok = recorded  # the tokenizer the run trained with
    elif tok is None and not str(recorded).startswith("char") and has_tokenizer_files(base.files_dir):
        tok = base.files_dir  # the base model's (a bare checkpoint with --base, or a moved run)
    card = None
    if src.actor_dir is not None:
        card = model_card(
            title=Path(args.out_dir).name or "policy",
            base_model=base.path,
            what=f"Exported by `aligner-convert export` from the training checkpoint of step {src.step}.",
            config=run_cfg,
            metrics=_run_metrics(run_cfg, src.step),
            step=src.step,
            extra_tags=_tags(run_cfg),
        )
    hf.export_hf(
        model,
        cfg,
        args.out_dir,
        arch,
        tokenizer_dir=tok,
        dtype=dtype,
        hf_config=base.hf_config,
        overwrite=args.overwrite,
        max_shard_size=args.max_shard_size,
        base_dir=base.files_dir,
        model_card=card,
    )
    if args.peft:
        export_peft_adapter(
            model, Path(args.out_dir) / "peft_adapter", arch, base_model=base.path, overwrite=True
        )


def _tags(run_cfg: dict) -> list[str]:
    adv = (run_cfg.get("ppo") or {}).get("advantage")
    lora = (run_cfg.get("lora") or {}).get("rank")
    return [t for t in (adv if adv and adv != "gae" else None, "lora" if lora else None) if t]


def _run_metrics(run_cfg: dict, step: int | None) -> dict:
    """The latest value of each metric up to ``step`` in the run's ``metrics.jsonl``, when the run
    directory is still where the checkpoint says (else nothing)."""
    run_dir = (run_cfg.get("logging") or {}).get("run_dir")
    path = os.path.join(run_dir, "metrics.jsonl") if isinstance(run_dir, str) else None
    if path is None or not os.path.isfile(path):
        return {}
    out: dict = {}
    try:
        for row in read_metrics(path):
            if step is None or int(row["step"]) <= step:
                out.update(row)
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 conversion error, 2 usage error)."""
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except (ConversionError, ConfigError, CheckpointError) as e:
        print(f"aligner-convert: error: {e}", file=sys.stderr)
        return 1
    print(f"aligner-convert: wrote {args.out_dir}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``aligner-convert``: Hugging Face folders <-> our model checkpoints.

    aligner-convert import HF_DIR CKPT_DIR [--role policy|critic|reward] [--tp N --pp N]
    aligner-convert export CKPT_DIR HF_DIR [--arch LlamaForCausalLM] [--tokenizer DIR]

Our checkpoints hold full tensors, so one process (TP=1, PP=1, the default) converts any
model that fits in memory. ``--tp/--pp`` build the model on that layout instead (launch that
many processes with ``torchrun``); the result is the same files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from aligner import distributed
from aligner.config_checks import ConfigError
from aligner.models import checkpoint_io, hf
from aligner.models.config import ConversionError
from aligner.models.hf_config import default_architecture, hf_architecture, read_hf_config

__all__ = ["main", "build_parser"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aligner-convert", description="Hugging Face folders <-> our model checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)

    def parallel(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tp", type=int, default=1, help="tensor-parallel size to build the model with")
        sp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to build the model with")
        sp.add_argument(
            "--dtype",
            choices=sorted(_DTYPES),
            default="float32",
            help="dtype of the model while converting, and of the written tensors",
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
    parallel(imp)

    exp = sub.add_parser("export", help="our checkpoint folder -> HF folder")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    exp.add_argument(
        "--arch",
        default=None,
        help="HF architecture or family (default: the one recorded at import, else the family the "
        "model's config fits: qwen3 for q/k norms, qwen2 for q/k/v biases, gpt2 for learned "
        "positions, llama)",
    )
    exp.add_argument("--tokenizer", default=None, help="folder whose tokenizer files are copied alongside")
    parallel(exp)
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
        meta = checkpoint_io.read_checkpoint_meta(args.ckpt_dir)
        meta["model_config"].check_parallel(args.tp, args.pp)

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
            model, cfg, meta = checkpoint_io.build_from_checkpoint(args.ckpt_dir, params_dtype=dtype)
            arch = args.arch or meta.get("hf_architecture") or default_architecture(cfg)
            hf.export_hf(
                model,
                cfg,
                args.out_dir,
                arch,
                tokenizer_dir=args.tokenizer,
                dtype=dtype,
                hf_config=meta.get("hf_config"),
                overwrite=args.overwrite,
            )
    finally:
        if owned:
            distributed.destroy()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 conversion error, 2 usage error)."""
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except (ConversionError, ConfigError) as e:
        print(f"aligner-convert: error: {e}", file=sys.stderr)
        return 1
    print(f"aligner-convert: wrote {args.out_dir}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

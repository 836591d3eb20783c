"""The versioned weight push (``aligner.generation.weight_push``) against a plain broadcast of the
same bytes, between two processes over gloo on the CPU.

    .venv/bin/python benchmarks/bench_weight_push.py [--mbytes 160] [--reps 5] [--json out.json]

Rank 0 pushes a synthetic weight stream of about ``--mbytes`` MB (fp32 and bf16 matrices and
vectors, shaped like a small GPT's: a large embedding, per-layer blocks, norms) to rank 1, which
receives and verifies every version. Reported per case: the median seconds of ``--reps`` runs
(interleaved, round by round) and GB/s of tensor bytes. Cases: ``broadcast`` (one
``dist.broadcast`` of all the bytes as one preallocated uint8 tensor: the floor), and the push
with buckets of 32 MB and 256 MB (each ending in the receivers' ack). ``checksum`` is the
checksum alone over the same bytes, on one process. Each process runs one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.distributed import free_port  # noqa: E402
from aligner.generation.weight_push import WeightPusher, WeightReceiver, checksum  # noqa: E402

BUCKETS = {"push_32MB": 32 << 20, "push_256MB": 256 << 20}


def make_stream(mbytes: float) -> list[tuple[str, torch.Tensor]]:
    """A GPT-like list of tensors of about ``mbytes`` MB: hidden 1024, vocab 8192, as many
    layers as fit (each: fp32 qkv, proj, fc1, fc2 and two bf16 norms)."""
    g = torch.Generator().manual_seed(0)
    h, v = 1024, 8192
    out = [("embedding.word_embeddings.weight", torch.randn(v, h, generator=g))]
    size, i = out[0][1].nbytes, 0
    while size < mbytes * 1e6:
        p = f"decoder.layers.{i}."
        for name, shape, dtype in [
            ("input_layernorm.weight", (h,), torch.bfloat16),
            ("self_attention.linear_qkv.weight", (3 * h, h), torch.float32),
            ("self_attention.linear_proj.weight", (h, h), torch.float32),
            ("pre_mlp_layernorm.weight", (h,), torch.bfloat16),
            ("mlp.linear_fc1.weight", (4 * h, h), torch.bfloat16),
            ("mlp.linear_fc2.weight", (h, 4 * h), torch.bfloat16),
        ]:
            t = torch.randn(shape, generator=g).to(dtype)
            out.append((p + name, t))
            size += t.nbytes
        i += 1
    return out


def worker(rank: int, port: int, mbytes: float, reps: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.new_group([0, 1], backend="gloo")
    stream = make_stream(mbytes) if rank == 0 else []
    total = torch.tensor([sum(t.nbytes for _, t in stream)], dtype=torch.int64)
    dist.broadcast(total, src=0)
    total = int(total.item())
    flat = torch.empty(total, dtype=torch.uint8)
    if rank == 0:
        flat.copy_(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in stream]))
    times: dict[str, list[float]] = {"broadcast": [], **{k: [] for k in BUCKETS}}
    version = 0
    receiver = WeightReceiver(group, 0)
    pushers = {case: WeightPusher(group, 0, bucket_bytes=b) for case, b in BUCKETS.items()}  # one each, kept
    for _ in range(reps):
        dist.barrier(group)
        t0 = time.perf_counter()
        dist.broadcast(flat, src=0, group=group)
        times["broadcast"].append(time.perf_counter() - t0)
        for case in BUCKETS:
            version += 1
            dist.barrier(group)
            t0 = time.perf_counter()
            if rank == 0:
                rep = pushers[case].push(version, iter(stream))
                assert rep.refused == 0 and rep.bytes == total
            else:
                got_version, tensors = receiver.receive()
                assert got_version == version and sum(t.nbytes for _, t in tensors) == total
            times[case].append(time.perf_counter() - t0)
    if rank == 0:
        t0 = time.perf_counter()
        checksum(flat[: total // 16 * 16])
        check_s = time.perf_counter() - t0
        report = {
            "mbytes": round(total / 1e6, 1),
            "tensors": len(stream),
            "reps": reps,
            "threads_per_process": 1,
            "cases": {
                case: {
                    "seconds": round(statistics.median(ts), 4),
                    "gbps": round(total / statistics.median(ts) / 1e9, 3),
                }
                for case, ts in times.items()
            }
            | {"checksum": {"seconds": round(check_s, 4), "gbps": round(total / check_s / 1e9, 3)}},
        }
        with open(path, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbytes", type=float, default=160.0, help="size of the weight stream, in MB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the JSON result here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "push.json")
        mp.spawn(worker, args=(free_port(), args.mbytes, args.reps, path), nprocs=2, join=True)
        with open(path) as f:
            report = json.load(f)
    print(json.dumps(report, indent=2))
    ref = report["cases"]["broadcast"]["seconds"]
    print(f"\n{'case':<14}{'s (median)':>12}{'GB/s':>8}{'x broadcast':>13}")
    for case, r in report["cases"].items():
        print(f"{case:<14}{r['seconds']:>12.4f}{r['gbps']:>8.3f}{r['seconds'] / ref:>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()

"""Critic server benchmark: what critic_infer costs on top of the bare critic forward,
requests/s under concurrency, and the server's throughput at data-parallel sizes 1 and 2.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_critic.py [--batch 8] [--seq 128] [--seconds 5]
        [--dp-sizes 1,2] [--dp-rows 16] [--dp-train-rows 64]

Starts a tiny critic server (2 layers, hidden 64, char tokenizer, reward = sort_reward) on free
ports and, in this process, the same critic for the bare forward. Prints a JSON object and a
table. Target: round-trip overhead < 3 ms for a [8, 128] batch.

Throughput by data-parallel size: a server per size in ``--dp-sizes`` (under torchrun when
> 1), four clients (each its own connection) sending ``[--dp-rows, --seq]`` critic_infer
requests back to back, and one client sending ``[--dp-train-rows, --seq]`` critic_train steps:
rows/s of each, and how many requests each execution merged (``server_info``'s ``batching``).
Each process of the server runs one thread: on a machine with fewer cores than the server,
Triton and the clients have processes, DP=2 cannot be faster than DP=1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from aligner.critic.config import build_config  # noqa: E402
from aligner.critic.launch import start_server  # noqa: E402
from aligner.critic.service import CriticService  # noqa: E402
from aligner.distributed import ParallelConfig, destroy, initialize  # noqa: E402
from aligner.models.forward import token_values  # noqa: E402
from aligner.tokenizers import build_tokenizer  # noqa: E402
from aligner.wire.client import RemoteCriticClient  # noqa: E402

MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 14}


def batch(b: int, s: int, seed: int = 0):
    """``b`` samples ``'dddd:' + digits + eos`` padded to exactly ``s`` tokens."""
    tok = build_tokenizer("char")
    rng = np.random.default_rng(seed)
    tokens = np.full((b, s), tok.pad_id, dtype=np.int64)
    lengths = np.zeros(b, np.int64)
    for i in range(b):
        n = int(rng.integers(s // 2, s - 1))
        prompt = tok.encode("".join(map(str, rng.integers(0, 10, 4))) + ":")
        resp = tok.encode("".join(map(str, rng.integers(0, 10, n - len(prompt) - 1)))) + [tok.eos_id]
        row = prompt + resp
        tokens[i, : len(row)] = row
        lengths[i] = len(row)
    return tokens, lengths, np.full(b, 5, np.int64)


def timeit(fn, n: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p10_ms": round(ms[len(ms) // 10], 3),
        "p90_ms": round(ms[(9 * len(ms)) // 10], 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


def throughput(url: str, threads: int, seconds: float, tokens, lengths, pl) -> dict[str, float]:
    """Requests/s with ``threads`` callers sharing one client (``threads`` workers)."""
    counts = [0] * threads
    stop = time.monotonic() + seconds
    with RemoteCriticClient(url, max_workers=threads) as client:
        client.infer(tokens, lengths, pl).result()

        def worker(i: int) -> None:
            while time.monotonic() < stop:
                client.infer(tokens, lengths, pl).result()
                counts[i] += 1

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        elapsed = time.monotonic() - t0
    total = sum(counts)
    return {
        "threads": threads,
        "requests": total,
        "requests_per_s": round(total / elapsed, 1),
        "rows_per_s": round(total * tokens.shape[0] / elapsed, 1),
    }


def dp_throughput(
    root: Path, model: dict, dp: int, rows: int, train_rows: int, seq: int, seconds: float, clients: int = 4
) -> dict:
    """critic_infer and critic_train rows/s of a server with ``dp`` replicas (see the module
    docstring), and the merge statistics of the infer load."""
    from aligner.critic.testing import train_arrays

    overrides = [
        "server.grpc_port=0",
        "server.metrics_port=null",
        "reward.fn=aligner.tasks.digits:sort_reward",
        f"parallel.data_parallel_size={dp}",
        f"server.max_batch_size={max(256, rows)}",
        f"server.max_request_batch={max(1024, train_rows)}",
        f"log.dir={root / f'dp{dp}' / 'log'}",
        "log.tensorboard=false",
        f"checkpoint.dir={root / f'dp{dp}' / 'ckpt'}",
    ] + [f"model.{k}={v}" for k, v in model.items()]
    server = start_server(overrides, nproc=dp, log_path=root / f"dp{dp}.log", ready_timeout_s=300)
    try:
        tokens, lengths, pl = batch(rows, seq, seed=dp)
        counts = [0] * clients
        with RemoteCriticClient(server.url) as c:
            for _ in range(3):  # warm-up
                c.infer(tokens, lengths, pl).result()
            before = c.info()["batching"]
        stop = time.monotonic() + seconds

        def worker(i: int) -> None:
            with RemoteCriticClient(server.url) as c:
                while time.monotonic() < stop:
                    c.infer(tokens, lengths, pl).result()
                    counts[i] += 1

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        infer_s = time.monotonic() - t0
        tt, tl, tp = batch(train_rows, seq, seed=10 + dp)
        returns, old_values, mask = train_arrays(tl, tp, seq, seed=dp)
        with RemoteCriticClient(server.url) as c:
            after = c.info()["batching"]
            c.train(tt, tl, returns, old_values, mask, 0).result()  # warm-up
            steps, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < seconds:
                steps += 1
                c.train(tt, tl, returns, old_values, mask, steps).result()
            train_s = time.monotonic() - t0
        hist = {
            k: n - before["requests_per_execution"].get(k, 0)
            for k, n in after["requests_per_execution"].items()
            if n != before["requests_per_execution"].get(k, 0)
        }
        executions = after["executions"] - before["executions"]
        requests = after["requests"] - before["requests"]
        return {
            "data_parallel_size": dp,
            "infer": {
                "clients": clients,
                "rows_per_request": rows,
                "requests": sum(counts),
                "rows_per_s": round(sum(counts) * rows / infer_s, 1),
                "executions": executions,
                "requests_per_execution_mean": round(requests / max(executions, 1), 3),
                "requests_per_execution_max": max((int(k) for k in hist), default=0),
                "requests_per_execution": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            },
            "train": {
                "rows_per_step": train_rows,
                "steps": steps,
                "rows_per_s": round(steps * train_rows / train_s, 1),
            },
        }
    finally:
        server.stop(timeout=60)


def echo_server(work_ms: float) -> None:
    """(Child process) a bare PyTriton model shaped like critic_infer whose callable only sleeps
    ``work_ms``; prints ``ECHO <grpc port>`` and serves until stdin closes."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    from aligner.critic.host import prepare_environment
    from aligner.distributed import free_port

    ws = prepare_environment() / f"bench-echo-{os.getpid()}"

    def infer(requests):
        if work_ms:
            time.sleep(work_ms / 1000)
        return [
            {"values": np.zeros((r["tokens"].shape[0], r["tokens"].shape[1] - 1), np.float32)}
            for r in requests
        ]

    port = free_port()
    triton = Triton(
        config=TritonConfig(
            http_port=free_port(), grpc_port=port, allow_metrics=False, log_verbose=0, exit_timeout_secs=1
        ),
        workspace=ws,
    )
    triton.bind(
        "echo",
        infer,
        inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,))],
        outputs=[Tensor(name="values", dtype=np.float32, shape=(-1,))],
        config=ModelConfig(
            batching=True, max_batch_size=64, batcher=DynamicBatcher(max_queue_delay_microseconds=0)
        ),
    )
    triton.run()
    print(f"ECHO {port}", flush=True)
    sys.stdin.read()
    triton.stop()


def pytriton_floor(tokens: np.ndarray, work_s: float, iters: int) -> dict[str, dict[str, float]]:
    """PyTriton's own transport for the same shapes, measured like the critic server (a separate
    server process, a gRPC client here), with a callable that just sleeps ``work_s`` (the critic
    server's measured time per request) and with one that returns at once."""
    import subprocess

    import tritonclient.grpc as grpcclient

    b, s = tokens.shape
    out = {}
    for name, w in (("same_work", work_s), ("no_work", 0.0)):
        proc = subprocess.Popen(
            [sys.executable, __file__, "--echo-server-ms", str(1000 * w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            line = ""
            while not line.startswith("ECHO "):
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError("the PyTriton echo server did not start")
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{int(line.split()[1])}")

            def call(client=client):
                i = grpcclient.InferInput("tokens", [b, s], "INT64")
                i.set_data_from_numpy(tokens)
                client.infer("echo", [i]).as_numpy("values")

            rt = timeit(call, iters)
            client.close()
        finally:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        out[name] = {
            "work_ms": round(1000 * w, 3),
            "round_trip_ms_mean": round(statistics.fmean(rt), 3),
            "transport_ms_mean": round(statistics.fmean(rt) - 1000 * w, 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--queue-delay-us", type=int, default=0)
    ap.add_argument(
        "--dp-sizes", default="1,2", help="data-parallel sizes to measure throughput at ('' skips)"
    )
    ap.add_argument("--dp-rows", type=int, default=16, help="rows per critic_infer request")
    ap.add_argument("--dp-train-rows", type=int, default=64, help="rows per critic_train step")
    ap.add_argument("--echo-server-ms", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.echo_server_ms is not None:
        echo_server(args.echo_server_ms)
        return
    torch.set_num_threads(1)

    root = Path(tempfile.mkdtemp(prefix="bench-critic-"))
    model = dict(MODEL, max_seq_len=max(args.seq, 64))
    common = {
        "log": {"dir": str(root / "log"), "tensorboard": False},
        "checkpoint": {"dir": str(root / "ckpt")},
        "model": model,
    }
    tokens, lengths, pl = batch(args.batch, args.seq)

    # The bare forward and the in-process service (validation + forward + reward function) run
    # here; the server runs the same critic in its own process (one core each). Each round trip is
    # paired with a bare forward timed right before it, so machine noise hits both alike.
    state = initialize(ParallelConfig(), seed=1234)
    service = CriticService(build_config({**common, "server": {"http_port": 0, "grpc_port": 0}}), state)
    t = torch.from_numpy(tokens)

    def bare():
        with torch.no_grad():
            token_values(service.critic, t)

    overrides = [
        "server.http_port=0",  # compared with gRPC below; loopback only, so no token needed
        "server.allow_no_token=true",
        "server.grpc_port=0",
        "server.metrics_port=null",
        "reward.fn=aligner.tasks.digits:sort_reward",
        f"server.max_queue_delay_us={args.queue_delay_us}",
        f"log.dir={root / 'log'}",
        "log.tensorboard=false",
        f"checkpoint.dir={root / 'ckpt'}",
    ]
    overrides += [f"model.{k}={v}" for k, v in model.items()]
    server = start_server(overrides, log_path=root / "server.log")
    try:
        result: dict = {"batch": [args.batch, args.seq], "model": model}
        pairs: dict[str, list[tuple[float, float]]] = {"service_infer_in_process": [], "grpc": [], "http": []}
        with RemoteCriticClient(server.url) as g, RemoteCriticClient(server.http_url) as h:
            calls = {
                "service_infer_in_process": lambda: service.infer(tokens, lengths, pl),
                "grpc": lambda: g.infer(tokens, lengths, pl).result(),
                "http": lambda: h.infer(tokens, lengths, pl).result(),
            }
            for fn in [bare, *calls.values()] * 5:  # warm-up
                fn()
            before = g.info()["extra"]["requests"]["critic_infer"]
            for _ in range(args.iters):
                for name, fn in calls.items():
                    b = timeit(bare, 1, warmup=0)[0]
                    pairs[name].append((b, timeit(fn, 1, warmup=0)[0]))
            after = g.info()["extra"]["requests"]["critic_infer"]
        # Time the server itself spent per request (validation, forward, reward function): the rest
        # of a round trip is transport (client, gRPC/HTTP, Triton, the Python backend hop).
        server_ms = 1000 * (after["seconds"] - before["seconds"]) / (after["requests"] - before["requests"])
        result["server_side_ms_mean"] = round(server_ms, 3)
        result["bare_forward"] = stats([b for name in pairs for b, _ in pairs[name]])
        for name, pp in pairs.items():
            key = name if name.startswith("service") else f"{name}_round_trip"
            result[key] = stats([x for _, x in pp])
            result[f"{name}_overhead_over_bare_forward_ms"] = round(
                statistics.median([x - b for b, x in pp]), 3
            )
            if not name.startswith("service"):
                result[f"{name}_transport_ms_mean"] = round(
                    statistics.fmean([x for _, x in pp]) - server_ms, 3
                )
        destroy()
        result["pytriton_floor"] = pytriton_floor(tokens, server_ms / 1000, args.iters)
        result["concurrency"] = [
            throughput(server.url, n, args.seconds, tokens, lengths, pl) for n in (1, 4, 8)
        ]
        server.stop()
        result["data_parallel"] = [
            dp_throughput(root, model, int(dp), args.dp_rows, args.dp_train_rows, args.seq, args.seconds)
            for dp in args.dp_sizes.split(",")
            if dp.strip()
        ]
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result, indent=2))
    print()
    print(f"critic_infer on [{args.batch}, {args.seq}] (tiny critic, 1 thread per process)")
    print(f"{'what':36s} {'median ms':>10s} {'p90 ms':>8s}")
    for key in ("bare_forward", "service_infer_in_process", "grpc_round_trip", "http_round_trip"):
        print(f"{key:36s} {result[key]['median_ms']:10.3f} {result[key]['p90_ms']:8.3f}")
    for name in ("service_infer_in_process", "grpc", "http"):
        print(
            f"{name + ' overhead (paired median)':36s} {result[name + '_overhead_over_bare_forward_ms']:10.3f}"
        )
    print(f"{'server-side time per request (mean)':36s} {result['server_side_ms_mean']:10.3f}")
    for name in ("grpc", "http"):
        print(f"{name + ' transport = round trip - server':36s} {result[name + '_transport_ms_mean']:10.3f}")
    f, f0 = result["pytriton_floor"]["same_work"], result["pytriton_floor"]["no_work"]
    print(f"{'bare PyTriton transport, same work':36s} {f['transport_ms_mean']:10.3f}")
    print(f"{'bare PyTriton transport, no work':36s} {f0['transport_ms_mean']:10.3f}")
    print(f"{'threads':>8s} {'req/s':>10s} {'rows/s':>10s}")
    for c in result["concurrency"]:
        print(f"{c['threads']:8d} {c['requests_per_s']:10.1f} {c['rows_per_s']:10.1f}")
    for d in result["data_parallel"]:
        i, t = d["infer"], d["train"]
        print(
            f"critic throughput DP={d['data_parallel_size']}: infer {i['rows_per_s']:.1f} rows/s "
            f"({i['clients']} clients x [{i['rows_per_request']}, {args.seq}], "
            f"{i['requests_per_execution_mean']:.2f} requests/execution, max {i['requests_per_execution_max']}), "
            f"train {t['rows_per_s']:.1f} rows/s ([{t['rows_per_step']}, {args.seq}] per step)"
        )


if __name__ == "__main__":
    main()

"""Side by side: this project's actor + critic server against TRL 1.12's ``PPOTrainer``
(``trl.experimental.ppo``, the last release that has it) on identical PPO work.

    .venv/bin/python benchmarks/bench_vs_trl.py [--cases B1,B2] [--precision bf16|fp32] [--updates 3]

This script is the driver; the parts it runs live in :mod:`benchmarks.vs_trl` (the cases and
their shared inputs, the FLOP count, each system's run, the report).

``make bench`` runs it (``make bench`` installs the ``bench`` extra: trl 1.12 and its
dependencies); without trl only our side runs. One invocation builds the shared inputs, then
runs each system in a fresh child process, case by case, and prints a JSON report and a table:
seconds per PPO update, generated tokens per second, TRL/ours ratios, the phase split, the
actor's idle share waiting on the server, and model FLOPs utilisation against the
matrix-product peak measured here (at the run's precision, on all cores).

Cases (a Llama-shaped model of 4 layers, hidden 256, 8 heads, FFN 680, vocabulary 512, built
from a config with seeded random weights, no download):

- B1: 64 prompts of 16 tokens, 48 new tokens, 4 PPO epochs, one minibatch;
- B2: the same with 192 new tokens and 1 PPO epoch.

The same work on both sides
---------------------------
- One HF folder per role, written once and loaded by both: the policy (``LlamaForCausalLM``;
  the reference starts as its copy) and a reward model (``LlamaForSequenceClassification``),
  which is also where the value model / critic starts, as TRL's examples and the N+
  implementation details do. A reward *model* (not a function), so both sides run its forward.
- One tokenizer folder (a word-level vocabulary of 512 built with ``tokenizers``, distinct
  ``<pad>`` and ``<eos>``), the same prompts (16 random word ids each).
- Sampling at temperature 1 over the full vocabulary; a response ends at ``<eos>`` on both
  sides (TRL ``stop_token="eos"``; ours always). Both keep decoding the whole batch until every
  row has stopped, and with 64 rows some row practically always runs to the limit, so both
  decode ``response_length`` steps: the decode work is identical, and generated tokens/s is
  counted as batch x response_length over the generation time on both sides.
- PPO: k1 KL penalty 0.05 against the reference, GAE (gamma 1, lambda 0.95), whitened
  advantages, ratio clip 0.2, clipped value loss (0.2), constant learning rate 3e-6 (TRL's
  default) for policy and value, AdamW, every PPO epoch one minibatch of all 64 samples, the
  value model trained for as many epochs as the policy.
- TRL runs with ``gradient_checkpointing=False`` (its ``PPOConfig`` turns it on by default,
  which recomputes every forward) and no sample generations or checkpoints; it is run with
  each attention implementation of ``--trl-attn`` (default ``sdpa`` and ``eager``: eager is the
  faster at 48 new tokens, sdpa at 192) and its fastest run is kept.

Known differences in the work: TRL reads the rollout log-probs from the generation scores;
our actor takes them from the first PPO pass's own forward (``ppo.reuse_rollout_forward``: with
one minibatch that forward runs on the rollout's weights and tokens, so its detached output is
the training forward's log-probs, and the entropy metric comes with it). TRL computes the
rollout values with a no-grad forward of the value model and trains it with fresh forwards;
our server keeps its ``critic_infer`` forward (with gradients) as the first training pass
(``optim.reuse_infer_forward``): one value forward fewer, which the FLOP count below still
counts (it is the work model of the algorithm, the same for both). TRL trains policy and value
with one optimizer on one summed loss (``vf_coef`` 0.1); we train them in two processes with
two optimizers: the same forwards, backwards and optimizer steps.

Precision
---------
``--precision bf16`` (default: the project's ``precision: auto`` on these CPUs, and
``PPOConfig``'s default ``bf16=True``) or ``fp32``; both sides run the same one. Ours: bf16
weights and compute with fp32 master weights in the actor and the server. TRL: its models
load in fp32 and train under torch autocast (fp32 master weights); the frozen reference and
reward model load in bf16. ``PPOTrainer`` builds its own ``Accelerator`` without passing the
precision on, so ``PPOConfig(bf16=True)`` alone runs fp32 on a CPU: this benchmark sets
``ACCELERATE_MIXED_PRECISION=bf16`` for it (``--trl-as-configured`` leaves that out, to
measure what the config alone gives). The report records what each side ran.

Forward
-------
``--model-forward`` (default ``compiled``) sets our actor's and server's ``model_forward``: the
fused forward under ``torch.compile``; with ``compiled`` the actor's decode step is compiled
too (``generation.decode_step=compiled``). The compiles (a few per process, one per graph and
shape) run in the warm-up updates, which are not measured; ``fused`` needs none. TRL runs its
models' eager forward, as ``PPOConfig``'s defaults (``torch_compile=False``) have it.

Threads
-------
Both systems get the whole machine. TRL is one process with ``--threads`` (default: all
cores) torch threads. Ours is two processes: the critic server with ``--server-threads``
(default 1) and the actor with ``--actor-threads`` (default: the cores left, at least 1),
raised to ``--gen-threads`` (default: all cores) while it generates, when the server has
normally finished the previous step's critic update and has nothing to do.

Timing
------
Each system runs ``--warmup`` updates (default 4: our processes compile a graph per new
sequence length in the first few, until their shapes go dynamic) and then ``--updates``
measured ones; seconds per update is the median wall time between the ends of consecutive
measured updates
(TRL: its ``on_step_end`` callback; ours: the metrics log's timestamps). On a shared machine
numbers move with other load: ``--repeats N`` runs N rounds, each system once per round in
alternating order (so that a slow spell falls on both systems' runs of a round), keeps each
system's best median, and also reports TRL's time over ours within each round and the median
of those ratios, and our actor's idle share in each round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the benchmarks package lives at the root

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.vs_trl.cases import CASES, build_inputs  # noqa: E402
from benchmarks.vs_trl.flops import matmul_peak, update_flops  # noqa: E402
from benchmarks.vs_trl.ours import run_ours  # noqa: E402
from benchmarks.vs_trl.report import report  # noqa: E402
from benchmarks.vs_trl.trl_side import run_trl, trl_available  # noqa: E402


def _child(role: str, case: str, inputs: Path, out: Path, args, attn: str) -> dict | None:
    """Run ``role`` ("ours" or "trl") on one case in a fresh process (this script with ``--role``):
    its JSON result, or None when it failed."""
    cmd = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--cases",
        case,
        "--inputs",
        str(inputs),
        "--result",
        str(out),
        "--warmup",
        str(args.warmup),
        "--updates",
        str(args.updates),
        "--precision",
        args.precision,
        "--server-threads",
        str(args.server_threads),
        "--trl-attn",
        attn,
        "--workdir",
        str(args.workdir),
    ]
    for flag in ("threads", "actor_threads", "gen_threads"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for o in args.actor_override or []:
        cmd += ["--actor-override", o]
    cmd += ["--model-forward", args.model_forward]
    if args.trl_as_configured:
        cmd.append("--trl-as-configured")
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # each child sets its own thread counts
    print(f"--- {role} {case}" + (f" (attention: {attn})" if role == "trl" else ""), flush=True)
    rc = subprocess.call(cmd, env=env, cwd=str(ROOT))
    if rc != 0 or not out.exists():
        print(f"{role} {case}: failed (exit code {rc})", file=sys.stderr, flush=True)
        return None
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="B1,B2", help=f"comma list of {list(CASES)}")
    ap.add_argument("--systems", default="ours,trl", help="comma list: ours, trl")
    ap.add_argument("--warmup", type=int, default=4, help="updates run before the measured ones")
    ap.add_argument("--updates", type=int, default=3, help="measured updates")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds per case, each running every system once (best median kept)",
    )
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--threads", type=int, default=None, help="TRL's torch threads (default: all cores)")
    ap.add_argument("--server-threads", type=int, default=1, help="our critic server's threads")
    ap.add_argument(
        "--actor-threads", type=int, default=None, help="our actor's threads (default: cores left)"
    )
    ap.add_argument("--gen-threads", type=int, default=None, help="our actor's threads while generating")
    ap.add_argument(
        "--trl-attn",
        default="sdpa,eager",
        help="attn_implementation(s) of TRL's HF models, comma separated: each is run, the fastest kept",
    )
    ap.add_argument(
        "--trl-as-configured",
        action="store_true",
        help="do not route TRL's bf16 flag to its Accelerator (PPOConfig(bf16=True) then runs fp32 on a CPU)",
    )
    ap.add_argument(
        "--model-forward",
        default="compiled",
        help="our actor's and server's model_forward (auto, fused, compiled, megatron; '' = their default)",
    )
    ap.add_argument("--actor-override", action="append", help="extra Hydra override for our actor")
    ap.add_argument("--workdir", default=None, help="where inputs and runs go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the JSON report here")
    ap.add_argument("--role", choices=("ours", "trl"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--inputs", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")  # library deprecation chatter; the report is the output

    if args.role is not None:  # a child: one system, one case
        case = CASES[args.cases]
        inputs = json.loads(Path(args.inputs).read_text())
        fn = run_ours if args.role == "ours" else run_trl
        fn(case, inputs, args, Path(args.result))
        return 0

    cases = [c for c in args.cases.split(",") if c]
    systems = [s for s in args.systems.split(",") if s]
    bad = [c for c in cases if c not in CASES] + [s for s in systems if s not in ("ours", "trl")]
    if bad:
        print(f"unknown case(s)/system(s) {bad}", file=sys.stderr)
        return 2
    if "trl" in systems and not trl_available():
        print(
            "trl 1.12 is not installed: TRL's side is skipped. Install the bench extra: "
            "pip install -e '.[bench]'",
            flush=True,
        )
        systems = [s for s in systems if s != "trl"]
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="bench-vs-trl-")
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    peaks = matmul_peak(args.threads or cores)
    results: dict[str, dict] = {}
    for name in cases:
        case = CASES[name]
        folder = Path(args.workdir) / f"inputs-{name}"
        inputs = build_inputs(case, folder)
        (folder / "inputs.json").write_text(json.dumps(inputs))
        results[name] = {}
        rounds: list[dict[str, float]] = []
        # Round by round (each system once per round), so that a slow spell of the machine
        # falls on both systems' runs of a round rather than on all of one system's; the order
        # alternates, so that going first or second is no system's advantage.
        for rep in range(args.repeats):
            this_round: dict[str, float] = {}
            for system in systems if rep % 2 == 0 else systems[::-1]:
                attns = [a for a in args.trl_attn.split(",") if a] if system == "trl" else ["-"]
                for attn in attns:
                    out = folder / f"{system}-{attn}-{rep}.json"
                    got = _child(system, name, folder / "inputs.json", out, args, attn)
                    if got is None:
                        continue
                    s = got["s_per_update"]
                    this_round[system] = min(this_round.get(system, s), s)
                    if system == "ours":
                        this_round["ours_idle"] = got["idle_share"]
                    best = results[name].get(system)
                    if best is None or s < best["s_per_update"]:
                        results[name][system] = got
            rounds.append(this_round)
        for system in systems:
            results[name].setdefault(system, None)
        results[name]["rounds"] = rounds
    flops = {name: update_flops(CASES[name]) for name in cases}
    full = {
        "precision": args.precision,
        "matmul_peak_gflops": peaks,
        "cores": cores,
        "model_flops_per_update": flops,
        "results": results,
    }
    print(json.dumps(full, indent=2))
    print()
    print(report(results, peaks, args.precision))
    if args.json:
        Path(args.json).write_text(json.dumps(full, indent=2))
    failed = any(r.get(s) is None for r in results.values() for s in systems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

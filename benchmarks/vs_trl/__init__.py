"""The parts of the side-by-side benchmark against TRL's ``PPOTrainer``, one thing each; the
script that runs them is ``benchmarks/bench_vs_trl.py``, whose docstring says what is compared.

- :mod:`~benchmarks.vs_trl.cases`: the benchmark shapes and the inputs both systems load;
- :mod:`~benchmarks.vs_trl.flops`: the model FLOPs of one update and the machine's matmul peak;
- :mod:`~benchmarks.vs_trl.ours`: our actor and critic server on a case;
- :mod:`~benchmarks.vs_trl.trl_side`: TRL's ``PPOTrainer`` on the same case;
- :mod:`~benchmarks.vs_trl.report`: the table and the round-by-round ratios.
"""

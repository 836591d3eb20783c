"""The one-command GPU check (``make gpu-check``, ``python -m aligner.gpu_check``,
``aligner-gpu-check``; docs/gpu-check.md): on the day a GPU machine is at hand, one command says
whether the project runs there and how fast, in one JSON report.

It composes both roles in one process, so it stands above them: it imports the actor's
composition root and the critic service, and neither of them imports it.

- :mod:`aligner.gpu_check.check`: the command line and the order of the sections, the report;
- :mod:`aligner.gpu_check.environment`: section a, the machine and the package versions;
- :mod:`aligner.gpu_check.pytest_run`: section b, ``pytest -m gpu`` in a subprocess;
- :mod:`aligner.gpu_check.ppo_run`: section c, a short PPO run of the real actor
  (:func:`aligner.actor.run.build_actor`) against the real critic service in this process;
- :mod:`aligner.gpu_check.handle`: that critic service as the actor's critic handle;
- :mod:`aligner.gpu_check.workload`: the model shapes, the synthetic tokenizer, prompts and reward;
- :mod:`aligner.gpu_check.measure`: bandwidth, matrix throughput, datasheet peaks, peak memory;
- :mod:`aligner.gpu_check.figures`: tokens/s against the bandwidth floor, MFU, phases, refit.

Nothing is imported here, so that importing the package stays cheap.
"""

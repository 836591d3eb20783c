"""The project's benchmarks, each a script that prints a JSON object and a table; ``make bench``
runs them one after the other (``benchmarks/run.py``). A package so that the parts of the TRL
comparison (:mod:`benchmarks.vs_trl`) import by name, from its script and from the tests alike."""

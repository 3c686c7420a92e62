"""The benchmark harness: `python -m benchmarks.run` times every provider of the ops against the roofline.

Modules: shapes (presets and cases), workloads (inputs and work of each op), providers and peers (who
is timed), check (correctness first), timing (CUDA events, memory, machine ceilings), measure (one case),
overhead (the dispatch handle's per-call cost), report (CSV, markdown, plots), env (provenance).
"""

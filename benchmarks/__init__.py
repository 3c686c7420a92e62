"""The benchmark harness: `python -m benchmarks.run` times every provider of the ops against the roofline.

Modules: shapes (presets and cases), workloads (inputs and work of each op), providers and peers (who
is timed), measure (one case: correctness first, then time and memory), overhead (the dispatch handle's
per-call cost), report (CSV, markdown, plots), env (provenance). The check, the timing and the host clocks are
liger_dispatch.timing, which `python -m liger_dispatch tune` shares. The other measurements (host_cost, hf_step,
vocab_parallel, fused_flce_bound, loss_kernels, mhc_kernels, helion_tune) run as `python -m benchmarks.run NAME`.
"""

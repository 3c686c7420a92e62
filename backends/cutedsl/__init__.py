"""CuTeDSL (nvidia-cutlass-dsl) backend for sm_90+: every kernel-level op.

ce, jsd, kl_div: one CTA streams one row (16-byte accesses, online softmax in fp32 registers), writing
the gradient over the logits in place. mhc: the mHC coefficients, x @ phi and the backward's products on
warp-level TF32 MMAs (_warp_mma) with the per-row sigmoid and Sinkhorn math in registers (_mhc_rows).
Kernels compile once per process per dtype, vector width and compile-time flags; rows, columns and row
stride are symbolic. _support holds the host side (capability, compile cache, launch), _row the row
kernels' device-side building blocks.
"""

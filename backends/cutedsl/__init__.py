"""CuTeDSL (nvidia-cutlass-dsl) backend: row kernels for the kernel-level losses on sm_90+.

ce, jsd, kl_div: one CTA streams one row (16-byte accesses, online softmax in fp32 registers), writing
the gradient over the logits in place. Kernels compile once per process per dtype, vector width and
compile-time flags; rows, columns and row stride are symbolic. _support holds the host side
(capability, compile cache, launch), _row the device-side building blocks.
"""

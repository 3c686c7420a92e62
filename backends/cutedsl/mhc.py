"""mHC coefficients: no CuTeDSL implementation yet, so the selector serves mhc_coeff_fwd / mhc_coeff_bwd from the
next backend. Both need a skinny tensor-core GEMM (x [M, K] @ phi [K, hc*hc + 2*hc]) fused with the RMS scaling and
the Sinkhorn epilogue to beat the Triton kernels; a CUDA-core version would be slower and, at this backend's
priority, would be picked over them.
"""

"""Fused Triton kernels of the CUDA decode path (importing this module needs Triton)."""

"""Paged attention backends: torch on CPU (and any device), Triton on CUDA."""

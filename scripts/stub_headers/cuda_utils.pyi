"""``deepinfer._C.cuda_utils``: device memory outside the framework's caching allocator, and IPC.

Served by the backend the plugin registry resolved (``deepinfer env`` shows which); every
backend has these signatures (tests/conformance). On the CUDA backend this layer is Python
over the native module, so this stub is kept by hand: scripts/gen_stubs.py checks that its
parameter names match the reference backend's functions.
"""

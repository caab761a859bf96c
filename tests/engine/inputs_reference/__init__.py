"""Pure-Python / numpy references of every step-builder layout (small and obviously right, not fast)."""

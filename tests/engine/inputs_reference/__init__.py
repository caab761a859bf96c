"""Pure-Python / numpy references of every Engine core II layout (small and obviously right, not fast)."""

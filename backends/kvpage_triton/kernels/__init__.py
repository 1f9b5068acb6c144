"""``@triton.jit`` kernels of the Triton backend (importing these imports triton)."""

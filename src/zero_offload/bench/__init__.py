"""Side-by-side benchmarks behind ``zero-offload bench``."""

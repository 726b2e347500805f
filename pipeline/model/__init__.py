"""The model: its JAX building blocks, one file per architecture family, the runner and numerics."""

"""CUDA backend (raw driver API)."""

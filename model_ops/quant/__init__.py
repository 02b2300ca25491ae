"""Quantized number formats: the pure-PyTorch reference of each (CPU path and kernel oracle)."""

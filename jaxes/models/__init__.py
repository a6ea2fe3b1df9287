"""Qwen2/2.5 decoder, KV cache, HF checkpoint conversion, and the perturbation hook."""

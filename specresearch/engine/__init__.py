"""The generation engine: speculative and autoregressive loops, decoding methods, the transformers adapter."""

"""Helpers for an engine's model runner, kept beside the core, not inside it.

Binding views to layer objects and KV sharing (``binding``); batch-shape
checks, multimodal placeholder scatter/gather and encoder timing (``batch``).
"""

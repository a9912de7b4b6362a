"""Helpers for an engine's model runner, kept beside the core, not inside it.

Binding views to layer objects and KV sharing (``binding``); the seed's
uniform-decode batch checks (``uniform_decode``) and its multimodal helpers —
placeholder scatter/gather, encoder output checks and timing (``multimodal``).
"""

"""Argument types and help text shared by the command-line tools."""

from __future__ import annotations

import argparse

from kvcore.memory.layout import KVCacheLayout


def plain(doc: str | None) -> str:
    """A docstring as terminal help text (no reStructuredText literals)."""
    return (doc or "").replace("``", "")


def layout_arg(text: str) -> KVCacheLayout:
    """argparse type: one layout name; the error lists the valid names."""
    try:
        return KVCacheLayout.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def layouts_arg(text: str) -> list[KVCacheLayout]:
    """argparse type: comma-separated layout names."""
    return [layout_arg(v) for v in text.split(",") if v.strip()]

"""Help text for the command line: docstrings as terminal text."""

from __future__ import annotations

import argparse

#: Descriptions keep their paragraphs and lists; option help is wrapped by argparse.
HelpFormatter = argparse.RawDescriptionHelpFormatter


def plain(doc: str | None) -> str:
    """A docstring as terminal help text (no reStructuredText literals)."""
    return (doc or "").replace("``", "")

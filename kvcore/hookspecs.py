"""The hook specifications, at the path SPEC §4 names; they live in :mod:`kvcore.plugins.hookspecs`."""

from kvcore.plugins.hookspecs import *  # noqa: F401,F403

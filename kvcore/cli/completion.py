"""``kvcore completion SHELL``: print a tab-completion script for bash, zsh or tcsh.

The script is generated from kvcore's own argparse parser by ``shtab``, so it
knows every command, benchmark and option (and the layout and dtype choices).
Install it once, e.g. for bash:

    kvcore completion bash > ~/.local/share/bash-completion/completions/kvcore

or for zsh (a directory on your ``$fpath``):

    kvcore completion zsh > ~/.zfunc/_kvcore
"""

from __future__ import annotations

import argparse

#: Shells shtab writes scripts for.
SHELLS = ("bash", "zsh", "tcsh")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh, tcsh)",
        description=(__doc__ or "").replace("``", "").split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        import shtab
    except ImportError:
        raise ValueError("shell completion needs the shtab package: pip install shtab") from None
    from kvcore.cli import build_parser

    # NOTE: the full parser (every command's and benchmark's options), as the shell needs them all.
    print(shtab.complete(build_parser(), shell=args.shell))
    return 0

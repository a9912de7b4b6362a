"""The README's engine example runs as written, and its CLI output is what kvcore prints."""

import re
import shlex
from pathlib import Path

import pytest

from kvcore.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_engine_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    engine = next(b for b in blocks if "KVCache.create" in b)
    namespace: dict = {}
    exec(compile(engine, str(README), "exec"), namespace)
    assert capsys.readouterr().out.split() == ["LBNHC", "2048", "[16]"]
    assert tuple(namespace["out"].shape) == (20, 8, 32)
    assert namespace["kv"].block_pool.num_free_blocks == namespace["kv"].num_blocks - 1


def _console_examples():
    """``(command, expected lines)`` of every ``$ kvcore ...`` in the README's console blocks."""
    for block in re.findall(r"```console\n(.*?)```", README.read_text(), re.S):
        command, expected = None, []
        for line in block.splitlines():
            if line.startswith("$ "):
                if command:
                    yield command, expected
                command, expected = line[2:], []
            else:
                expected.append(line)
        if command:
            yield command, expected


EXAMPLES = [e for e in _console_examples() if e[0].startswith("kvcore ")]


def test_readme_shows_cli_output():
    assert {c.split()[1] for c, _ in EXAMPLES} >= {"plan"}


@pytest.mark.parametrize("command, expected", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_readme_cli_output_is_what_kvcore_prints(capsys, monkeypatch, command, expected):
    """Each quoted output is the command's output at 80 columns; "..." stands for lines left out."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(shlex.split(command)[1:]) == 0
    captured = capsys.readouterr()
    actual = (captured.out + captured.err).splitlines()
    chunks, chunk = [], []
    for line in expected + ["..."]:
        if line == "...":
            if chunk:
                chunks.append(chunk)
            chunk = []
        else:
            chunk.append(line)
    start = 0
    for chunk in chunks:
        found = next((i for i in range(start, len(actual)) if actual[i : i + len(chunk)] == chunk), None)
        assert found is not None, f"README lines not printed by `{command}`:\n" + "\n".join(chunk)
        start = found + len(chunk)

"""The README's engine example runs as written, and the CLI output it and docs/ quote is what kvcore prints."""

import re
import shlex
from pathlib import Path

import pytest

from kvcore.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: Everything a user reads: the README, docs/, the benchmarks' figures and the changelog.
USER_DOCS = [*PAGES, ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md"]


def test_readme_engine_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    engine = next(b for b in blocks if "KVCache.create" in b)
    namespace: dict = {}
    exec(compile(engine, str(README), "exec"), namespace)
    assert capsys.readouterr().out.split() == ["LBNHC", "2048", "[16]"]
    assert tuple(namespace["out"].shape) == (20, 8, 32)
    assert namespace["kv"].block_pool.num_free_blocks == namespace["kv"].num_blocks - 1


def _console_examples():
    """``(command, expected lines)`` of every ``$ kvcore ...`` in the console blocks of the README and docs/."""
    blocks = [b for page in PAGES for b in re.findall(r"```console\n(.*?)```", page.read_text(), re.S)]
    for block in blocks:
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
    assert len(EXAMPLES) >= 3  # the README's plan, and docs/planning.md's two


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


def test_readme_is_a_front_door_whose_links_resolve():
    assert len(README.read_text().splitlines()) <= 450
    for page in USER_DOCS:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    mapped = README.read_text().split("## Repository", 1)[1]
    for doc in (ROOT / "docs").glob("*.md"):
        assert doc.name in mapped, f"the README's repository map leaves out docs/{doc.name}"


def test_make_demo_prints_the_readmes_next_three_commands():
    makefile = (ROOT / "Makefile").read_text()
    printed = [c.strip() for c in re.findall(r'@echo "  (\.venv/bin/[^"]+)"', makefile)]
    venv = README.read_text().split("### Using the venv", 1)[1]
    shown = [line.split("#")[0].strip() for line in re.search(r"```bash\n(.*?)```", venv, re.S).group(1).splitlines()]
    assert len(printed) == 3 and printed == shown
    assert "source .venv/bin/activate" in venv and "source .venv/bin/activate" in makefile


SHORTHAND = re.compile(
    r"SPEC §|\b(?:first|second|third|fourth|fifth|sixth|seventh) (?:round|session|wave)\b|\blent\b"
    r"|\bthe seed'?s?\b|(?<![\w/&])#\d+\b",
    re.I,
)


@pytest.mark.parametrize("page", USER_DOCS, ids=[p.name for p in USER_DOCS])
def test_user_docs_speak_without_internal_shorthand(page):
    found = [m.group(0) for m in SHORTHAND.finditer(page.read_text())]
    assert not found, f"{page.name} uses shorthand a reader cannot decode: {found}"


def test_benchmarks_md_has_a_section_per_benchmark_that_says_how_to_reproduce_it():
    text = (ROOT / "BENCHMARKS.md").read_text()
    sections = {s.split("\n", 1)[0]: s for s in text.split("\n## ")[1:]}
    for name in ("zero", "plan", "pool", "transfer", "hf", "elastic"):
        section = next((s for title, s in sections.items() if f"`kvcore bench {name}`" in title), None)
        assert section is not None, f"BENCHMARKS.md has no section for kvcore bench {name}"
        assert "Reproduce:" in section and "20" in section  # the command, and a dated figure
    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    for part in set(re.findall(r"gpu_check\.sh (\w+)", text)) - {"PART"}:
        assert f"part_{part}()" in check, f"BENCHMARKS.md cites a part gpu_check.sh does not have: {part}"

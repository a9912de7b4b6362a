"""The README's prefix-caching example runs as written and prints what it says."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_prefix_caching_example_runs(capsys):
    section = README.read_text().split("## Prefix caching", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(example, str(README), "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == ["0 True", "2 True"]
    pool = namespace["pool"]
    assert pool.num_free_blocks == pool.num_blocks - 1 and pool.num_evictable_blocks == 2

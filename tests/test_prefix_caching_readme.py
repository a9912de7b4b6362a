"""docs/prefix-caching.md's example runs as written and prints what it says."""

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "prefix-caching.md"


def test_readme_prefix_caching_example_runs(capsys):
    example = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(example, str(PAGE), "exec"), namespace)
    assert capsys.readouterr().out.splitlines() == ["0 True", "2 True"]
    pool = namespace["pool"]
    assert pool.num_free_blocks == pool.num_blocks - 1 and pool.num_evictable_blocks == 2

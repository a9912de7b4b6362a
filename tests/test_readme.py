"""The README's engine example runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_engine_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    engine = next(b for b in blocks if "KVCache.create" in b)
    namespace: dict = {}
    exec(compile(engine, str(README), "exec"), namespace)
    assert capsys.readouterr().out.split() == ["LBNHC", "2048", "[16]"]
    assert tuple(namespace["out"].shape) == (20, 8, 32)
    assert namespace["kv"].block_pool.num_free_blocks == namespace["kv"].num_blocks - 1

"""Micro-benchmarks behind ``kvcore bench <name>``.

Benchmark ``name`` is module ``kvcore.bench.<name>``: its options are in
:mod:`kvcore.bench.options` (no torch) and its ``run(args) -> int`` returns the
exit code. Modules that are not installed are left out of the command line.
"""

from kvcore.bench.options import ARGUMENTS

#: Benchmark name -> its module, in the order ``kvcore bench --help`` lists them.
BENCHMARKS: dict[str, str] = {name: f"{__name__}.{name}" for name in ARGUMENTS}

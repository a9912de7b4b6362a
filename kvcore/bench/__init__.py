"""Micro-benchmarks behind ``kvcore bench <name>``.

Each benchmark module defines ``add_arguments(parser)`` and ``run(args) -> int``
(an exit code). ``BENCHMARKS`` maps a name to its module; modules that are not
installed are left out of the command line.
"""

BENCHMARKS: dict[str, str] = {
    "zero": "kvcore.bench.zero",
    "plan": "kvcore.bench.plan",
    "transfer": "kvcore.bench.transfer",
    "hf": "kvcore.bench.hf",
    "pool": "kvcore.bench.pool",
    "elastic": "kvcore.bench.elastic",
}

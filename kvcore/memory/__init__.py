"""Stage 2 of the pipeline: from specs to bytes.

Layouts and strides (``layout``), the plan's records (``config``), the planner
(``plan_groups``, ``planner``), views over the one allocation (``views``),
device memory budgets (``budget``), and an elastic cache's reserved backing
memory (``backing``, ``backing_cuda``) committed for its first blocks
(``elastic``). Nothing here talks to plugins.
"""

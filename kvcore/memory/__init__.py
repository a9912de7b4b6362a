"""Stage 2 of the pipeline, from specs to bytes: layouts, strides and block runs (``layout``),
the plan's records (``config``, ``plan_groups``, ``planner``), views over the one allocation
(``views``), memory budgets (``budget``) and an elastic cache's backing memory (``backing``,
``backing_cuda``, ``elastic``). Nothing here talks to plugins.
"""

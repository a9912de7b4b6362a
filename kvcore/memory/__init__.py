"""Stage 2 of the pipeline, from specs to bytes: layouts and strides (``layout``), the plan
(``config``, ``planner``), views over the one allocation (``views``), memory budgets (``budget``)
and an elastic cache's memory (``elastic``, ``backing``, ``backing_cuda``). No plugins here.
"""

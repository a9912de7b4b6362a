"""Stage 2 of the pipeline: from specs to bytes.

Layouts and strides (``layout``), the plan's records (``config``), the planner
(``plan_groups``, ``planner``), views over the one allocation (``views``) and
device memory budgets (``budget``). Nothing here talks to plugins.
"""

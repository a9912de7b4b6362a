"""Stage 2, from specs to bytes: layouts, the plan, views, budgets and elastic memory."""

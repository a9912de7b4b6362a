"""Stage 2, from specs to bytes: layouts, the plan, views over the one allocation, memory
budgets and an elastic cache's memory (the README's repository map names each module)."""

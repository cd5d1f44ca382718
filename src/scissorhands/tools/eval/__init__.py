"""Quality of compressed caches on real data: tasks, a grid runner, summaries and plots."""

from .catalog import TASKS, make_task
from .runner import plot_results, run_grid, summary_table

__all__ = ["TASKS", "make_task", "plot_results", "run_grid", "summary_table"]

"""Quality of compressed caches on real data: tasks, a grid runner, summaries and plots."""

from .catalog import TASKS, make_task
from .report import plot_results, summary_table
from .runner import run_grid

__all__ = ["TASKS", "make_task", "plot_results", "run_grid", "summary_table"]

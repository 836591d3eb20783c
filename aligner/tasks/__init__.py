"""Built-in prompt sets and programmatic rewards (the demo's task and the learning tests)."""

from aligner.tasks.digits import TASKS, DigitTask, get_task

__all__ = ["TASKS", "DigitTask", "get_task"]

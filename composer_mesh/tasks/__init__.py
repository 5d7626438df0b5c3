"""Small verifiable tasks: prompts with checkable answers, reward functions, and SFT pairs for warm starts."""

from composer_mesh.tasks.base import Task, get_task

__all__ = ["Task", "get_task"]

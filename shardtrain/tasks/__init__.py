"""The task seam: what a user brings (model, loss, data) as a ``Task`` subclass returning
``LossOutput``s; ``from shardtrain.tasks import Task, LossOutput``."""

from shardtrain.tasks.task import LossOutput, Task

__all__ = ["LossOutput", "Task"]

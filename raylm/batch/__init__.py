"""Batch jobs on Ray Data: `raylm batch -i INPUT -o OUTPUT`, or run_batch(input=..., output=...)."""

from raylm.batch.config import BatchArgs
from raylm.batch.job import BatchSummary, run_batch

__all__ = ["BatchArgs", "BatchSummary", "run_batch"]

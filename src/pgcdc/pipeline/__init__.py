"""The pipeline: wires replication -> transactions -> spark; the one package that knows every room.

``loop`` is the pipeline itself (start there); ``snapshotter`` copies tables, ``batcher`` collects
transactions into change tables, ``applier`` merges batches on the apply thread, ``tables`` holds each
table's converter, key and mirror. What moves the slot, and why that is safe: :mod:`pgcdc.checkpoint`.
"""

from typing import TYPE_CHECKING

from pgcdc.lazy_exports import lazy_exports
from pgcdc.pipeline.config import PipelineConfig, Progress

if TYPE_CHECKING:
    from pgcdc.pipeline.loop import Pipeline

__all__ = ["Pipeline", "PipelineConfig", "Progress"]

__getattr__ = lazy_exports(__name__, {"Pipeline": "pgcdc.pipeline.loop"})

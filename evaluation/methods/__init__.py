"""The evaluation grid's transfer methods, one module per method (the cells' `method`).

A grid file has a section per method, named after it::

    fewshot:  {shots: [1, 5, 10, 25], seeds: 3}
    finetune: {enabled: false}

Each method's module holds:

- ``NAME`` (its cells' `method` and its grid section's key), ``TITLE`` (how messages name it);
- ``Config``: its grid section (a `base.MethodSection`, with ``enabled``; unset settings fall back
  to each benchmark's protocol in :mod:`vitray.evaluation.suite`);
- ``plan(checkpoint, benchmark, section, data)``: its cells of one (checkpoint, benchmark), on the
  benchmark's data of digest ``data``, as units of work (`base.GridWork`) and work that waits for
  other cells' scores (`base.PendingWork`);
- ``RUNS_AS``: ``base.TASK`` -- each unit runs in a Ray task that calls the module's
  ``run(work, section, inputs)`` with the section's ``num_cpus`` / ``num_gpus`` (a `base.TaskSection`)
  -- or ``base.TRAINING_RUN`` (fine-tune: each unit is a Ray Train run the driver starts).

The grid's config (`vitray.evaluation.config.GridConfig`), its plan (`vitray.evaluation.grid`)
and its runners (`cluster/evaluate.py`) take the methods from :data:`METHODS`, and the results
table and report treat any method's rows alike: a new method is one module here and its line in
:data:`METHODS`.
"""

from __future__ import annotations

from types import ModuleType

from vitray.evaluation.methods import fewshot, finetune
from vitray.evaluation.methods.base import (
    METRIC,
    TASK,
    TRAINING_RUN,
    CheckpointRef,
    GridWork,
    Inputs,
    MethodSection,
    PendingWork,
    Planned,
    TaskSection,
)

METHODS: dict[str, ModuleType] = {module.NAME: module for module in (fewshot, finetune)}
"""Method name -> its module, in the order the grid submits their work."""

__all__ = [
    "METHODS",
    "METRIC",
    "TASK",
    "TRAINING_RUN",
    "CheckpointRef",
    "GridWork",
    "Inputs",
    "MethodSection",
    "PendingWork",
    "Planned",
    "TaskSection",
]

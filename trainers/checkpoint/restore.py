"""Which checkpoint a rank resumes from, and its local copy: the worker's side of a resume, in one
place (`Checkpointer.restore` then loads it into every component).

The driver announces the checkpoint it chose and verified with `resume_point`, and its step. At
the start of an attempt every rank takes that one: nothing is read again. After Ray Train restarted
the worker group inside the run (a lost worker), the run folder may hold newer checkpoints than
the driver saw, so rank 0 asks `resume_point` again, knowing the announced one: only the
checkpoints written since are read, and one whose files were lost or cut short after Ray
registered it is never loaded. Rank 0 tells the others its answer; each rank then copies what its
engine reads of it (`Engine.restore_files`; the ranks of one node share the files they all read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vitray.runfolder.checkpoint_folders import (
    CheckpointInfo,
    IncompleteCheckpointError,
    mark_corrupt,
    marked_corrupt,
    resume_point,
)
from vitray.trainers.checkpoint.checked_copy import node_restore_dir, start_rank_copy
from vitray.trainers.collectives import broadcast_json
from vitray.trainers.config import TrainingConfig
from vitray.trainers.context import WorkerContext


def choose_checkpoint(run_dir: str, announced: str | None, step: int | None, *, restarted: bool) -> str | None:
    """The checkpoint to resume from (None: from scratch); asked on rank 0. `announced` (with its
    `step`, when known) is the driver's choice; `restarted`: Ray restarted the worker group. An
    announced checkpoint that an earlier group of this attempt found corrupt (`mark_corrupt`) is
    passed over as any newer incomplete one is."""
    corrupt = announced is not None and marked_corrupt(announced)
    if not restarted and not corrupt:
        return announced
    known = CheckpointInfo(announced, int(step), True) if announced and step is not None else None
    chosen, skipped = resume_point(run_dir, known=known)
    for c in skipped:
        print(f"vitray: skipped newer checkpoint {c.path}: {c.problem}", flush=True)
    if chosen is None and not corrupt:
        raise RuntimeError(f"Ray restarted the run {run_dir} from a checkpoint, but it has no complete checkpoint")
    return chosen.path if chosen is not None else None


@contextlib.contextmanager
def restore_copy(cfg: TrainingConfig, ctx: WorkerContext) -> Iterator[tuple[Path, dict[str, Any]] | None]:
    """This rank's local copy of the checkpoint the run resumes from and its trainer state, or None
    for a run from scratch; a collective (rank 0 chooses). A local checkpoint's files are checked
    (CRC-32C) by whoever reads them whole in the body (the engine's load: `checked_copy.file_check`),
    the rest on leaving (`start_rank_copy`), which raises IncompleteCheckpointError if a file is
    corrupt. The copy is removed on
    leaving, once the last rank of the node has loaded it: training does not need it any more."""
    path = broadcast_json(
        choose_checkpoint(ctx.run_dir, ctx.resume_from, ctx.resume_step, restarted=ctx.restarted)
        if ctx.rank == 0
        else None,
        ctx.device,
    )
    if path is None:
        yield None
        return
    try:
        with node_restore_dir(path, cfg.checkpoint.staging_dir) as node_dir:
            folder, state, checking = start_rank_copy(
                path, cfg.engine.restore_files(cfg, ctx.rank, ctx.world_size), node_dir, ctx.rank
            )
            try:
                yield folder, state
            except Exception as error:
                # A corrupt file can make the load fail first, with an error that does not say so.
                problem = checking.exception() if checking is not None else None
                if problem is not None:
                    raise problem from error
                raise
            if checking is not None:
                checking.result()  # before anything trains on what was loaded
    except IncompleteCheckpointError as damaged:
        # It would fail every resume the same way: from now on it does not count, and the next
        # attempt (Ray's restart, or a re-run) resumes from the checkpoint before it.
        mark_corrupt(path, damaged.reason)
        raise

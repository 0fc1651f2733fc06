"""A run folder's checkpoints on a real S3 store (SeaweedFS, tests/conftest.py), the way a run
leaves them: pruned by two processes (the workers' rank 0 and the driver), each with its own
s3fs listing cache, and pruned folders that the store goes on listing as empty prefixes."""

from __future__ import annotations

from pathlib import Path

from vitray import storage
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.runfolder.listing import run_summary
from vitray.trainers.checkpoint.rank_files import files_under, mark_complete, write_state


def _upload_checkpoints(tmp_path: Path, run_dir: str, steps: list[int], first_minute: int = 0) -> list[str]:
    """Complete one-rank checkpoints at `steps`, written locally and uploaded by a client of their
    own (another process's, as far as this process's s3fs cache knows); their paths."""
    import s3fs

    uploader = s3fs.S3FileSystem(skip_instance_cache=True)
    paths = []
    for minute, step in enumerate(steps, start=first_minute):
        name = f"checkpoint_2026-01-01_00-{minute:02d}-00.000001"
        folder = tmp_path / "local" / name
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 100)
        write_state(folder, {"step": step, "world_size": 1})
        mark_complete(folder, 0, files_under(folder))
        uploader.put(str(folder), f"{storage.filesystem(run_dir)[1]}/{name}", recursive=True)
        paths.append(storage.join(run_dir, name))
    return paths


def _delete_elsewhere(path: str) -> None:
    """`path` deleted by another process (rank 0's prune): this process's s3fs cache is not told."""
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).rm(storage.filesystem(path)[1], recursive=True)


def _steps(run_dir: str) -> list[int | None]:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # what a new process sees
    return [c.step for c in ckpt.find_checkpoints(run_dir)]


def test_the_driver_prune_after_rank_0_deleted_checkpoints_keeps_checkpoint_keep(seaweed_s3, tmp_path):
    """The driver lists the run at start-up (s3fs caches the listings); meanwhile the workers write
    new checkpoints and rank 0 prunes old ones. The driver's last prune used to read a checkpoint
    that was gone ("The specified key does not exist") and stop there: keep=2 left 3."""
    run_dir = seaweed_s3.url("runs", "r")
    old = _upload_checkpoints(tmp_path, run_dir, [4, 8, 12, 16])
    assert [c.step for c in ckpt.find_checkpoints(run_dir)] == [4, 8, 12, 16]  # the driver's start-up look
    newer = _upload_checkpoints(tmp_path, run_dir, [20], first_minute=4)  # the workers go on
    for path in old[:2]:
        _delete_elsewhere(path)  # rank 0's prune (keep=2 at step 16)

    deleted = ckpt.prune_checkpoints(run_dir, keep=2)  # the driver's, at the end of the run
    assert deleted == [old[2]]
    assert _steps(run_dir) == [16, 20]
    assert ckpt.latest_complete_checkpoint(run_dir).path == newer[0]


def test_a_checkpoint_deleted_while_the_prune_runs_counts_as_deleted(seaweed_s3, tmp_path, monkeypatch):
    """Two prunes at once: the other one deletes an old checkpoint while this one checks the newest.
    It is gone, which is what this prune wanted too: no error, and not said deleted by this one."""
    run_dir = seaweed_s3.url("runs", "r")
    paths = _upload_checkpoints(tmp_path, run_dir, [4, 8, 12])
    check = ckpt.check_checkpoint

    def deleted_meanwhile(folder):
        if Path(str(folder)).name == Path(paths[2]).name:
            _delete_elsewhere(paths[0])
        return check(folder)

    monkeypatch.setattr(ckpt, "check_checkpoint", deleted_meanwhile)
    assert ckpt.prune_checkpoints(run_dir, keep=1) == paths[1:2]  # the one it deleted itself
    assert _steps(run_dir) == [12]


def test_a_pruned_checkpoint_listed_as_an_empty_prefix_is_not_a_checkpoint(seaweed_s3, tmp_path):
    """SeaweedFS lists a deleted folder as a prefix with nothing under it for a while (for good if
    it restarts meanwhile): `vitray runs` said `ignored checkpoint_...: no trainer_state.json: it
    was not finished` of every pruned checkpoint. A prefix with nothing in it is no checkpoint."""
    run_dir = seaweed_s3.url("runs", "r")
    paths = _upload_checkpoints(tmp_path, run_dir, [4, 8, 12])
    assert ckpt.prune_checkpoints(run_dir, keep=1) == paths[:2]
    storage.filesystem(run_dir)[0].invalidate_cache()
    names = storage.list_names(run_dir)
    assert Path(paths[0]).name in names, f"the store no longer lists the pruned folder: {names}"  # the case here

    summary = run_summary(run_dir)
    assert summary.incomplete == [] and "ignored" not in summary.status, summary
    assert summary.num_checkpoints == 1 and summary.latest_checkpoint == paths[2]
    assert [c.step for c in ckpt.find_checkpoints(run_dir)] == [12]
    assert ckpt.resume_point(run_dir) == (ckpt.find_checkpoints(run_dir)[0], [])


def test_a_deleted_run_listed_as_an_empty_prefix_is_not_a_run(seaweed_s3, tmp_path):
    """The same for a whole run folder deleted (`aws s3 rm --recursive`): `vitray runs` listed it
    as a run with no complete checkpoint yet."""
    from vitray.runfolder.files import RunFiles
    from vitray.runfolder.listing import list_runs

    storage_root = seaweed_s3.url("runs")
    kept, deleted = (storage.join(storage_root, name) for name in ("kept", "deleted"))
    for run_dir in (kept, deleted):
        _upload_checkpoints(tmp_path / run_dir.rsplit("/", 1)[-1], run_dir, [4])
        RunFiles(run_dir).new_attempt("a1")
    _delete_elsewhere(deleted)
    storage.filesystem(storage_root)[0].invalidate_cache()
    assert "deleted" in storage.list_names(storage_root)  # the store still lists it (the case here)

    assert [run.name for run in list_runs(storage_root)] == ["kept"]


def test_a_pinned_checkpoint_survives_the_prune_of_another_process_on_s3(seaweed_s3, tmp_path):
    """A reader's pin written to S3 (`vitray evaluate` of a live run) is seen by the run's prune,
    which lists the run afresh: the pinned checkpoint is left, and goes at the prune after the
    reader let go."""
    from vitray.runfolder.pins import CheckpointPins

    run_dir = seaweed_s3.url("runs", "pinned")
    paths = _upload_checkpoints(tmp_path, run_dir, [4, 8, 12])
    storage.write_bytes_atomic(storage.join(run_dir, "vitray", "metrics.jsonl"), b"")
    ckpt.find_checkpoints(run_dir)  # this process's listings cached before the pin
    with CheckpointPins([paths[0]]):
        assert ckpt.prune_checkpoints(run_dir, keep=1) == paths[1:2]
    assert ckpt.prune_checkpoints(run_dir, keep=1) == paths[:1]
    assert _steps(run_dir) == [12]

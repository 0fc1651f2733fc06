"""A resumed run ends with the weights of the run that went straight through with a step's
randomness on (dropout, mixup): the one-process training loop, no Ray (the end-to-end resumes of
test_pretrain and test_faults_pretrain train without dropout)."""

from __future__ import annotations

from pathlib import Path

from pretrain_helpers import assert_same_weights, in_process_loop


def test_a_run_resumed_with_dropout_and_mixup_ends_with_the_straight_runs_weights(
    process_group, digits_dataset, tmp_path
):
    """The first batch of every attempt once drew from the generator that the step had just seeded
    for its dropout (the loader's iterator starting): a resumed run's first step had other dropout
    masks, and its weights differed from then on (1e-3 after a few steps)."""
    from vitray.runfolder import checkpoint_folders as ckpt

    extra = (
        "train.steps=6",
        "checkpoint.every=3",
        "log.every=3",
        "model.dropout=0.1",
        "model.attn_dropout=0.1",
        "train.mixup_alpha=0.2",
        "data.num_workers=1",
    )
    saved: dict[str, list[str]] = {"straight": [], "resumed": []}

    def keep(name):
        return lambda metrics, folder: saved[name].append(folder)

    in_process_loop(digits_dataset, tmp_path / "straight", *extra, report=keep("straight")).run()
    restore = Path(saved["straight"][0])
    resumed = in_process_loop(digits_dataset, tmp_path / "b", *extra, restore_dir=restore, report=keep("resumed"))
    assert resumed.step == 3
    resumed.run()

    def weights(folder: str) -> dict:
        return ckpt.model_weights(folder, ckpt.storage.filesystem(folder)[0], ckpt.read_state(folder))

    assert_same_weights(weights(saved["resumed"][-1]), weights(saved["straight"][-1]))

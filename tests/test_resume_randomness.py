"""A resumed run ends with the weights of the run that went straight through with a step's
randomness on (dropout, mixup): the one-process training loop, no Ray (the end-to-end resumes of
test_pretrain and test_faults_pretrain train without dropout)."""

from __future__ import annotations

from pretrain_helpers import assert_same_weights, straight_and_resumed


def test_a_run_resumed_with_dropout_and_mixup_ends_with_the_straight_runs_weights(
    process_group, digits_dataset, tmp_path
):
    """The first batch of every attempt once drew from the generator that the step had just seeded
    for its dropout (the loader's iterator starting): a resumed run's first step had other dropout
    masks, and its weights differed from then on (1e-3 after a few steps)."""
    extra = (
        "train.steps=6",
        "checkpoint.every=3",
        "log.every=3",
        "model.dropout=0.1",
        "model.attn_dropout=0.1",
        "train.mixup_alpha=0.2",
        "data.num_workers=1",
    )
    straight, resumed = straight_and_resumed(digits_dataset, tmp_path, *extra)
    assert_same_weights(resumed, straight)

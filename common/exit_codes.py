"""What a vitray command's exit status means (docs/resuming-and-faults.md, "Exit codes", lists the
same). Here, below every layer, because `vitray submit` reads them back from a job's driver."""

OK = 0
FAILED = 1  # the work failed; the message says whether re-running the same command can help
INPUT_ERROR = 2  # a config or input the command refused, before Ray started
PREEMPTED = (
    75  # stopped on a pre-emption notice (SIGTERM, a node drain) after a checkpoint: re-run to resume (EX_TEMPFAIL)
)
STOPPED_BY_USER = 130  # Ctrl-C (128 + SIGINT): after a checkpoint on the first, at once on the second
GRACE_RAN_OUT = 143  # 128 + SIGTERM: the workers had not checkpointed when run.preemption_grace_s was over

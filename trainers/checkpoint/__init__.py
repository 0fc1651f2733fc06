"""One rank's side of the run's checkpoints: when to save and the background write, restoring
every component (`checkpointer.py`), the files it writes (`rank_files.py`), its checked copy of the
one it resumes from (`checked_copy.py`, reading DeepSpeed's shards with `torch_file.py`), and which
checkpoint that is (`restore.py`)."""

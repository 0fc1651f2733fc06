"""One rank's side of the run's checkpoints: when to save and the background write, restoring
every component (`checkpointer.py`), the files it writes and its local copy of the one it resumes
from (`rank_files.py`), and which checkpoint that is (`restore.py`)."""

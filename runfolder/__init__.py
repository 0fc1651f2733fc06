"""A run folder on storage and what the driver does with it, read and written from the files alone
(no Ray, no DeepSpeed):

- :mod:`vitray.runfolder.checkpoint_folders`: the checkpoint folders, when one counts as complete
  (and why not), and `resume_point`, the one answer to where a run resumes from (the driver,
  pre-flight and the workers ask it);
- :mod:`vitray.runfolder.lease` (and :mod:`~vitray.runfolder.lease_s3`): one driver per run;
- :mod:`vitray.runfolder.files`: the run's own files (attempts, metrics, markers, stop notice);
- :mod:`vitray.runfolder.listing`: what `vitray runs` shows;
- :mod:`vitray.runfolder.progress`: the driver's progress bar, fed by the metrics file;
- :mod:`vitray.runfolder.export` (and :mod:`~vitray.runfolder.timm_folder`): `vitray export`.

Below trainers and evaluation: they (and cluster, cli) import it; it imports only common, storage and
models. A worker writes its checkpoint files with `vitray.trainers.checkpoint.rank_files`. The folder is
not called ``runs/``: ``./runs`` is where runs live by default (``run.storage``), so run folders
would be written into the source tree.
"""

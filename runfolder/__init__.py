"""A run folder on storage and what the driver does with it, read and written from the files alone
(no Ray, no DeepSpeed): the checkpoint folders and when one counts as complete
(:mod:`vitray.runfolder.checkpoints`), where a run resumes from (:mod:`vitray.runfolder.resume`, the
one answer the driver, pre-flight and the workers use), the driver's lease
(:mod:`vitray.runfolder.lease`), the run's own files -- attempts, metrics, markers
(:mod:`vitray.runfolder.files`) --, the listing behind `vitray runs` (:mod:`vitray.runfolder.listing`),
the driver's progress bar (:mod:`vitray.runfolder.progress`) and `vitray export`
(:mod:`vitray.runfolder.export`).

Below trainers and evaluation: they (and cluster, cli) import it; it imports only common, data and
models. The folder is not called ``runs/``: ``./runs`` is where runs live by default
(``run.storage``), so run folders would be written into the source tree.
"""

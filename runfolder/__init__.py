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

from __future__ import annotations

from typing import Any

__all__ = ["load_checkpoint"]


def load_checkpoint(path: str, *, ema: bool = True) -> tuple[Any, dict[str, Any]]:
    """The trained model of a vitray checkpoint, for use in Python: ``(model, info)``.

    ``path`` is a checkpoint folder or a run folder (then its latest complete checkpoint), local or
    ``s3://``. The model is built from the checkpoint's own record (name, resolution, depth, head,
    classes), with its EMA weights where the run kept them and ``ema`` is true (the weights vitray
    evaluates and exports), or derived from the shards of a checkpoint written without its
    consolidated weights. A checkpoint that does not count (a rank never finished writing it, a
    file fails its CRC-32C) is refused with :class:`~vitray.runfolder.checkpoint_folders.IncompleteCheckpointError`,
    and is pinned while it is read, so that a live run's pruning does not delete it under the read.
    ``info`` is the checkpoint's trainer state: ``info["checkpoint"]`` the folder read, ``"step"``,
    ``"num_classes"``, ``"model"`` and the run's ``"config"``. The model is in training mode, as
    built; call ``model.eval()`` to score it. Its ``pretrained_cfg`` (timm's) says how the run
    evaluated it (the range [-1, 1], the resize and crop of its ``val`` evaluation), so that
    ``timm.data.create_transform(**timm.data.resolve_data_config(model=model))`` makes those inputs."""
    from vitray.runfolder.checkpoint_folders import load_checkpoint as load
    from vitray.runfolder.timm_folder import eval_resize_of, pretrained_cfg

    model, info = load(path, ema=ema, pin=True)
    evaluation = eval_resize_of((info.get("config") or {}).get("evals"))
    model.pretrained_cfg = pretrained_cfg(model, evaluation, f"vitray {model.name}, step {info['step']} of {path}")
    return model, info

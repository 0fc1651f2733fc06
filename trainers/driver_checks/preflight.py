"""The driver's pre-flight check of a training run: everything a user can get wrong that the
workers would otherwise find minutes later, checked in seconds before Ray starts.

Two parts, in the order the driver needs them:

- :func:`check_inputs`, before the run's lease is taken: storage reachable with the credentials
  at hand, every dataset prepared (``dataset.json``, the split, a first shard that is a tar), the
  model buildable at the configured size (on the meta device: nothing allocated), ``init.checkpoint``
  complete.
- :func:`check_resume`, under the lease: where the run resumes from, whether its recorded config
  can load into the new one (a change of architecture, classes, objective, backend, precision,
  ZeRO stage or optimizer is refused, naming the keys), what else changed (said, allowed), and
  whether the run is already finished.

Each refusal is a :class:`PreflightError`: one line naming the cause and the fix.
"""

from __future__ import annotations

import os
import posixpath
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from vitray import storage
from vitray.common.config import flatten_config
from vitray.common.redact import redacted_config
from vitray.data.layout import DatasetInfo, is_prepared_dataset, read_dataset_info, read_split
from vitray.data.splits import parse_split, slice_bounds
from vitray.models import TRAINING_SETTINGS, ModelConfig, create_model_from_config, on_meta_device
from vitray.runfolder import checkpoint_folders as ckpt
from vitray.runfolder.files import run_dir as run_folder
from vitray.trainers.config import TrainingConfig
from vitray.trainers.step.float8 import float8_layer_names, local_gpu_fp8_problem, no_float8_layer, torchao_missing
from vitray.trainers.step.objectives import resolve_objective
from vitray.trainers.trackers import missing_tracker_packages, mlflow_store_problem, wandb_login_missing

__all__ = [
    "PreflightError",
    "ResumePlan",
    "check_held_out",
    "check_inputs",
    "check_model",
    "check_resume",
    "config_changes",
    "model_to_train",
]

# Config keys whose change makes a checkpoint unloadable into the new run: the weights' shapes,
# what the head predicts, and the layout of the optimizer state that DeepSpeed / XLA restore.
FIXED_ON_RESUME = (
    "model.name",
    "model.depth",
    "model.img_size",
    "model.head",
    "model.representation_size",
    "model.masked_patch_outputs",
    "train.backend",
    "train.objective",
    "train.zero_stage",
    "precision.dtype",
    "optim.name",
)
# Keys that name the run itself or only where things are read from: a change is not reported.
_UNREPORTED = ("run.", "init.", "cluster.address")


class PreflightError(ValueError):
    """A run that cannot start as configured (one line: the cause and the fix)."""


class CheckpointNotHere(PreflightError):
    """init.checkpoint cannot be read from here: not there, or its store not reachable."""


@dataclass
class ResumePlan:
    chosen: ckpt.CheckpointInfo | None  # None: from scratch
    skipped: list[ckpt.CheckpointInfo] = field(default_factory=list)  # newer, incomplete checkpoints
    changes: list[str] = field(default_factory=list)  # "key: old -> new", allowed on resume
    finished: bool = False  # the chosen checkpoint is at or past train.steps


def check_inputs(cfg: TrainingConfig) -> DatasetInfo:
    """Storage, datasets, model and initial weights of `cfg`; returns the training dataset's info."""
    options = cfg.data.storage_options  # the data's; the run folder is written with the environment's
    if storage.is_remote(cfg.run.storage):  # a local run folder is made where it does not exist yet
        try:
            storage.check_reachable(cfg.run.storage, writable=True)
        except storage.StorageUnreachable as err:
            raise PreflightError(f"run.storage: {err}") from None
    else:
        _check_writable_folder("run.storage", cfg.run.storage)
    _check_not_a_dataset(cfg)
    info, samples = _check_dataset("data.train", cfg.data.train, cfg.data.train_split, options)
    try:
        resolve_objective(cfg.train.objective, info.label_kind)  # what the workers would refuse
    except ValueError as err:
        raise PreflightError(f"data.train: {err}") from None
    checked = set()  # (path, split) of the val evaluators: data.val's unless a section names its own
    for name, ev in cfg.evals.items():
        scored = ev.dataset(cfg.data) if ev.type == "val" else None
        if scored is None or scored in checked:
            continue
        key = "data.val" if scored == (cfg.data.val_path, cfg.data.val_split) else f"evals.{name}"
        _check_same_labels(key, scored[0], _check_dataset(key, *scored, options)[0], cfg.data.train, info)
        if scored[0] == cfg.data.train:
            split_key = "data.val_split" if key == "data.val" else f"evals.{name}.split"
            check_held_out(split_key, scored[1], "data.train_split", cfg.data.train_split, info)
        checked.add(scored)
    for name, ev in cfg.evals.items():
        for dataset_name, path in getattr(ev, "datasets", {}).items():
            probed, _ = _check_dataset(f"evals.{name}.datasets.{dataset_name}", path, None, options)
            _check_enough_shots(f"evals.{name}", dataset_name, probed, max(ev.shots))
    missing = missing_tracker_packages(cfg.log.mlflow, cfg.log.wandb)
    if missing:
        raise PreflightError(
            f"{' and '.join(missing)} not installed: pip install 'vitray[trackers]', or unset the setting"
        )
    # On the local Ray the workers share this environment and its stores; a cluster's nodes may hold
    # their own key, and reach stores this machine does not.
    problem = None if cfg.cluster.address else mlflow_store_problem(cfg.log.mlflow)
    if problem:
        raise PreflightError(problem)
    if not cfg.cluster.address and wandb_login_missing(cfg.log.wandb):
        raise PreflightError(
            "log.wandb: no W&B API key here: set WANDB_API_KEY (or run `wandb login`), or set log.wandb.mode=offline"
        )
    model = _check_init_checkpoint(cfg, info.num_classes) if cfg.init.checkpoint else cfg.model
    if cfg.precision.dtype == "fp8":
        _check_fp8_can_run(cfg)
    shapes = check_model(model, info.num_classes)
    if cfg.precision.dtype == "fp8" and not float8_layer_names(
        shapes, cfg.precision.fp8_scaling, cfg.precision.fp8_layers
    ):
        raise PreflightError(no_float8_layer(cfg.precision.fp8_layers))
    if samples is not None and samples < cfg.train.batch_size:  # what every worker's loader would refuse
        raise PreflightError(
            f"data.train={cfg.data.train} split {cfg.data.train_split} has {samples:,} samples, fewer than one "
            f"batch (train.batch_size={cfg.train.batch_size}): use a smaller train.batch_size, or a larger split"
        )
    return info


def _check_same_labels(key: str, path: str, scored: DatasetInfo, train_path: str, train: DatasetInfo) -> None:
    """A validation set scores the run's classifier: its labels must be data.train's. Another
    number of classes (or single- against multi-label) gave a top-1 of other labels (0.000, or a
    number that looked right); the same number under other names is said, not refused (one
    dataset prepared from two sources names its classes two ways)."""
    if "none" in (scored.label_kind, train.label_kind):
        return  # unlabelled: nothing is scored against labels
    if (scored.num_classes, scored.label_kind) != (train.num_classes, train.label_kind):
        raise PreflightError(
            f"{key}={path} has {scored.num_classes} classes ({scored.label_kind}-label), data.train={train_path} "
            f"{train.num_classes} ({train.label_kind}-label): its top-1 would score other labels. Give a validation "
            "set of the training set's classes (data.val, or the same dataset's split: data.val_split)"
        )
    differing = [i for i, (a, b) in enumerate(zip(scored.classes, train.classes, strict=False)) if a != b]
    if differing:
        differ = differing[0]
        print(
            f"vitray: note: {key}={path} names its classes otherwise than data.train (class {differ}: "
            f"{scored.classes[differ]!r} against {train.classes[differ]!r}); its top-1 counts them as the same",
            file=sys.stderr,
            flush=True,
        )


def check_held_out(
    val_key: str, val_split: str, train_key: str, train_split: str, info: DatasetInfo, *, same_ok: bool = True
) -> None:
    """A validation slice of the training dataset shares no sample with the training slice: a top-1
    of samples the run trains on looked like a held-out one (`train[:90%]` against `train[80%:]`,
    or `train` against `train[:98%]`). The very slice the run trains on is said to be a training
    accuracy where `same_ok` (a deliberate look at a run's fit), else refused too (a grid's
    learning rate is selected on its validation slice)."""
    val, train = parse_split(val_split), parse_split(train_split)
    if val.name != train.name or val.name not in info.splits:
        return
    size = info.splits[val.name].num_samples
    (val_start, val_stop), (train_start, train_stop) = slice_bounds(val, size), slice_bounds(train, size)
    if same_ok and (val_start, val_stop) == (train_start, train_stop):
        print(
            f"vitray: note: {val_key}={val_split} is the split the run trains on ({train_key}={train_split}): "
            "its top-1 is a training accuracy, not a held-out one",
            file=sys.stderr,
            flush=True,
        )
        return
    first, last = max(val_start, train_start), min(val_stop, train_stop)
    if first < last:
        raise PreflightError(
            f"{val_key}={val_split} and {train_key}={train_split} share {last - first:,} samples ([{first}:{last}] "
            f"of {val.name}'s {size:,}): its top-1 would be measured on samples the run trains on. Hold out a slice "
            f"the training slice leaves out, e.g. {train_key}={val.name}[:98%] with {val_key}={val.name}[98%:]"
        )


def _check_enough_shots(key: str, dataset_name: str, info: DatasetInfo, shots: int) -> None:
    """A few-shot probe draws `shots` examples of every class from the train split: fewer samples
    there than that in all would fail the run at its first evaluation (which may be hours in)."""
    train = info.splits.get("train")
    needed = shots * info.num_classes
    if train is not None and train.num_samples < needed:
        raise PreflightError(
            f"{key}.shots: {shots} shots of each of the {info.num_classes} classes of {dataset_name} need {needed:,} "
            f"samples in its train split, which has {train.num_samples:,}; lower {key}.shots"
        )


def _check_fp8_can_run(cfg: TrainingConfig) -> None:
    """torchao present and, where the workers use GPUs and this machine has one (a single machine,
    a GPU head node), that GPU has float8 tensor cores. Other nodes' GPUs are checked by each worker
    as it builds its engine, with the same message. (Which layers train in float8 is checked on the
    model `check_model` builds.)"""
    problem = (local_gpu_fp8_problem() if cfg.cluster.gpus_per_worker > 0 else None) or torchao_missing()
    if problem:
        raise PreflightError(problem)


def check_resume(cfg: TrainingConfig, run_dir: str, info: DatasetInfo) -> ResumePlan:
    """Where the run at `run_dir` resumes and whether `cfg` can continue it."""
    chosen, skipped = ckpt.resume_point(run_dir)
    if chosen is None:
        return ResumePlan(None, skipped)
    state = chosen.state  # what resume_point read when it verified the checkpoint
    try:
        ckpt.refuse_newer_format(chosen.path, state)
    except ckpt.NewerCheckpointFormat as newer:
        raise PreflightError(f"run {cfg.run.name} cannot resume here: {newer}") from None
    recorded = _with_todays_defaults(state.get("config") or {})
    new = redacted_config(cfg)
    for config in (recorded, new):  # "auto" and what it resolves to on this dataset are the same objective
        train = config.get("train", {})
        if train.get("objective") == "auto":
            train["objective"] = "sigmoid" if info.label_kind == "multi" else "softmax"
    # A checkpoint of an engine without ZeRO stages loads whatever train.zero_stage says
    fixed_keys = FIXED_ON_RESUME if cfg.engine.zero_stages else tuple(set(FIXED_ON_RESUME) - {"train.zero_stage"})
    fixed, changed = config_changes(recorded, new, fixed_keys)
    where = f"run {cfg.run.name} (checkpoint at step {chosen.step}, {chosen.path})"
    if fixed:
        raise PreflightError(
            f"{where} cannot resume with a changed {', '.join(fixed)}: its checkpoint would not load. Keep "
            f"{'that value' if len(fixed) == 1 else 'those values'} as recorded, or start a new run (another run.name)"
        )
    for what, old, new in (
        ("classes", state.get("num_classes"), info.num_classes),
        ("label kind", state.get("label_kind"), info.label_kind),
    ):
        if old is not None and old != new:
            raise PreflightError(
                f"{where} was trained on {old} {what} but data.train={cfg.data.train} has {new}: its head would "
                "not load. Resume on the same dataset, or start a new run (another run.name)"
            )
    _check_data_stream(cfg, where, state.get("data") or {})
    return ResumePlan(chosen, skipped, changed, finished=chosen.step >= cfg.train.steps)


def _check_data_stream(cfg: TrainingConfig, where: str, stream: dict[str, Any]) -> None:
    """The checkpoint's position in the data stream (`vitray.data.ShardLoader.state_dict`) means
    something only in the same stream: the seed, the slots, the shuffle buffer and the samples
    decide which sample comes next. Another would fail every worker at its restore."""
    changed = [
        f"{key}: {old} -> {new}"
        for key, old, new in (
            ("seed", stream.get("seed"), cfg.seed),
            ("data.num_slots", stream.get("num_slots"), cfg.data.num_slots or stream.get("num_slots")),
            ("data.shuffle_buffer", stream.get("shuffle_buffer"), cfg.data.shuffle_buffer),
        )
        if old is not None and old != new
    ]
    if changed:
        raise PreflightError(
            f"{where} cannot resume with a changed {', '.join(changed)}: they decide the order of its data "
            "stream, whose position the checkpoint holds. Keep them as recorded, or start a new run (another run.name)"
        )
    slots = cfg.data.num_slots or stream.get("num_slots")
    if slots and slots % cfg.cluster.num_workers:  # what every worker would refuse, Ray started
        divisors = [d for d in range(1, slots + 1) if slots % d == 0]
        raise PreflightError(
            f"{where} reads its data in {slots} slots (data.num_slots, as recorded), which "
            f"cluster.num_workers={cfg.cluster.num_workers} cannot share: resume it on a number of workers among "
            f"{divisors}, or start a new run (another run.name)"
        )
    if "num_samples" in stream:
        samples = read_split(cfg.data.train, cfg.data.train_split, cfg.data.storage_options).num_samples
        if samples != stream["num_samples"]:
            raise PreflightError(
                f"{where} was trained on {stream['num_samples']:,} samples but data.train={cfg.data.train} split "
                f"{cfg.data.train_split} has {samples:,}: its position in the data stream means nothing there. Resume "
                "on the same dataset and split, or start a new run (another run.name)"
            )


def _with_todays_defaults(recorded: dict[str, Any]) -> dict[str, Any]:
    """The recorded config with the keys added to vitray since it was written at their defaults, so
    that they are not reported as changes (`evals.val.resize: None -> aspect`); as written where it
    no longer validates (a key renamed since: the comparison names it)."""
    try:
        return redacted_config(TrainingConfig.model_validate(recorded))
    except Exception:
        return recorded


def changes_since(cfg: TrainingConfig, state: dict[str, Any]) -> list[str]:
    """How `cfg` differs from the config a checkpoint's trainer `state` recorded ("key: old -> new"
    or "key (old -> new)"), keys added to vitray since at their defaults."""
    fixed, changed = config_changes(_with_todays_defaults(state.get("config") or {}), redacted_config(cfg))
    return fixed + changed


def init_changes(cfg: TrainingConfig, state: dict[str, Any]) -> list[str]:
    """How `cfg`'s starting weights (`init.*`) differ from those the run whose checkpoint `state`
    recorded started from ("key: old -> new"). Not a change to report while a run resumes -- its
    own checkpoint replaces them -- but a finished run started from other weights is not this
    config's result."""
    recorded = (state.get("config") or {}).get("init") or {}
    given = redacted_config(cfg)["init"]
    return [
        f"init.{key}: {recorded[key]} -> {value}"
        for key, value in sorted(given.items())
        if key in recorded and recorded[key] != value
    ]


def config_changes(
    recorded: dict[str, Any], new: dict[str, Any], fixed_keys: tuple[str, ...] = FIXED_ON_RESUME
) -> tuple[list[str], list[str]]:
    """(the `fixed_keys` that differ, "key (old -> new)"; "key: old -> new" for every other difference)."""
    old_flat, new_flat = flatten_config(recorded), flatten_config(new)
    fixed, changed = [], []
    for key in sorted(old_flat.keys() | new_flat.keys()):
        old, value = old_flat.get(key), new_flat.get(key)
        if old == value or key.startswith(_UNREPORTED):
            continue
        if key in fixed_keys:
            fixed.append(f"{key} ({old} -> {value})")
        else:
            changed.append(f"{key}: {old} -> {value}")
    return fixed, changed


def _check_not_a_dataset(cfg: TrainingConfig) -> None:
    """The run's folder is no prepared dataset, nor inside one (a `run.storage` given the data's
    folder): its checkpoints and records were written among the shards."""
    folder = run_folder(cfg.run.storage, cfg.run.name)
    for key, path in (("run.storage", cfg.run.storage), ("run.name", folder)):
        if is_prepared_dataset(path):
            raise PreflightError(
                f"{key}: the run folder {folder} would be {'inside ' if key == 'run.storage' else ''}the prepared "
                f"dataset {path} (it holds dataset.json): give the runs a folder of their own (run.storage)"
            )


def _check_writable_folder(key: str, path: str) -> None:
    """A local folder that exists and can be written, or that can be made (only a probe folder is
    made here, and removed at once: a refused run leaves nothing behind)."""
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise PreflightError(f"{key}={path}: {existing} is a file, not a folder; pick another {key}")
    # os.access answers yes to root whatever the file system says (/proc, a read-only or root-squashed
    # mount): a folder made and removed at once is the answer that holds.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vitray-check-", dir=existing))
    except OSError as err:
        raise PreflightError(
            f"{key}={path}: {existing} cannot be written ({err.strerror}); pick another {key}"
        ) from None


def _check_dataset(
    key: str, path: str, split: str | None, options: dict[str, Any] | None
) -> tuple[DatasetInfo, int | None]:
    """The dataset at `path`, reachable and whole enough to start on: its info and the number of
    samples of `split` (None: no split asked)."""
    try:
        storage.check_reachable(path, must_exist=True, storage_options=options)
    except storage.StorageUnreachable as err:
        raise PreflightError(f"{key}: {err}") from None
    if not storage.is_remote(path) and os.path.isfile(path):  # e.g. one of the dataset's shards
        raise PreflightError(
            f"{key}={path} is a file; give the folder `vitray data prepare` wrote (the one holding dataset.json), "
            f"e.g. {os.path.dirname(path)}"
        )
    try:
        if split is None:
            return read_dataset_info(path, options), None
        resolved = read_split(path, split, options)
    except KeyError as err:  # the split is not there; the message lists the ones there are
        raise PreflightError(f"{key}={path}: {err.args[0]}; pick one of them") from None
    except (FileNotFoundError, ValueError) as err:
        raise PreflightError(f"{key}={path}: {err}") from None
    if len(resolved.shard_urls):
        _check_shards_listed(key, path, [str(url) for url in resolved.shard_urls], resolved.shard_bytes, options)
        _check_first_shard(key, resolved.shard_urls[0], options)
    return resolved.info, resolved.num_samples


def _check_shards_listed(
    key: str, path: str, urls: list[str], sizes: Sequence[int], options: dict[str, Any] | None
) -> None:
    """Every shard the manifest lists for the split is in the storage, of the size it lists (one
    listing of the folder): a missing one would fail every worker after Ray started, and a restart
    cannot bring it back; one cut short (a copy onto a full disk) was trained on to the end, exit 0,
    its samples skipped."""
    present = storage.file_sizes(path, options)
    names = [posixpath.basename(url) for url in urls]
    missing = [name for name in names if name not in present]
    if missing:
        raise PreflightError(
            f"{key}={path}: {len(missing)} of the {len(urls)} shards the manifest lists are missing "
            f"({missing[0]}{', ...' if len(missing) > 1 else ''}); prepare the dataset again "
            "(`vitray data prepare ... --overwrite`)"
        )
    other = [
        (name, present[name], int(size)) for name, size in zip(names, sizes, strict=False) if present[name] != size
    ]
    if other:
        name, held, listed = other[0]
        raise PreflightError(
            f"{key}={path}: {len(other)} of the {len(urls)} shards are not of the size the manifest lists ({name}: "
            f"{held:,} bytes, listed {listed:,}{'; ...' if len(other) > 1 else ''}): a copy cut short? `vitray data "
            "verify` names each; copy them again, or prepare the dataset again (`vitray data prepare ... --overwrite`)"
        )


def _check_first_shard(key: str, url: str, options: dict[str, Any] | None) -> None:
    """The first shard begins with a valid tar header (one 512-byte read): a folder of random or
    cut-off files is refused now, not after every sample of a run has been skipped."""
    try:
        with storage.open_file(url, "rb", options) as f:
            header = f.read(tarfile.BLOCKSIZE)
        tarfile.TarInfo.frombuf(header, tarfile.ENCODING, "surrogateescape")
    except FileNotFoundError:
        raise PreflightError(
            f"{key}: shard {url} is listed in the manifest but missing; prepare the dataset "
            "again (`vitray data prepare ... --overwrite`)"
        ) from None
    except tarfile.TarError as err:
        raise PreflightError(
            f"{key}: shard {url} is not a tar archive ({err}); prepare the dataset again "
            "(`vitray data prepare ... --overwrite`)"
        ) from None


def _check_init_checkpoint(cfg: TrainingConfig, num_classes: int | None = None) -> ModelConfig:
    """init.checkpoint is complete; the model it gives at this run's resolution (what the loop builds).
    `num_classes`: the training data's, which a head kept (init.reset_head=false) must have."""
    path = cfg.init.checkpoint
    try:
        storage.check_reachable(path, must_exist=True)  # read as the run folder is: the environment's credentials
        state = ckpt.resolve_checkpoint(path).state
    except (FileNotFoundError, storage.StorageUnreachable) as err:
        raise CheckpointNotHere(f"init.checkpoint: {err}") from None
    except ckpt.IncompleteCheckpointError as err:
        raise PreflightError(f"init.checkpoint: {err}") from None
    # (and with this run's dropout and activation checkpointing: how it trains is the run's own)
    settings = cfg.model.model_dump(include=set(TRAINING_SETTINGS))
    theirs = ModelConfig.model_validate({**state["model"], **settings, "img_size": cfg.model.img_size})
    # The weights decide the architecture; a model.name, depth or head that says otherwise would be
    # recorded as the run's while it trains the checkpoint's (only the resolution and the classifier
    # are adapted). A depth of None is the variant's own and so is no claim: a fine-tune recipe
    # copies the checkpoint's model section, None included.
    given = (
        ("name", theirs.name, theirs.name),
        ("depth", theirs.blocks, f"{theirs.name} of {theirs.blocks} blocks"),
        ("head", theirs.head, f"model with a {theirs.head} head"),
    )
    for key, value, held in given:
        ours = getattr(cfg.model, key)
        if key in cfg.model.model_fields_set and ours is not None and ours != value:
            raise PreflightError(
                f"init.checkpoint {path} holds a {held}, but model.{key}={ours}: fine-tuning keeps the "
                f"checkpoint's architecture; set model.{key}={value} or leave it out"
            )
    _check_representation_size(cfg, path, theirs.representation_size)
    held = state.get("num_classes")
    kept = not cfg.init.reset_head and cfg.model.masked_patch_outputs is None
    if kept and num_classes is not None and held is not None and int(held) != num_classes:
        # (the loop gave such a run a fresh head without a word)
        raise PreflightError(
            f"init.reset_head=false keeps the head of init.checkpoint {path}, of {held} classes, but data.train="
            f"{cfg.data.train} has {num_classes}: set init.reset_head=true for a fresh head, or train on data of "
            f"its {held} classes"
        )
    if cfg.model.masked_patch_outputs is not None:  # the loop gives it masked patch prediction's parts
        update = {"masked_patch_outputs": cfg.model.masked_patch_outputs, "representation_size": None}
        theirs = theirs.model_copy(update=update)
    return theirs


def _check_representation_size(cfg: TrainingConfig, path: str, held: int | None) -> None:
    """A model.representation_size given with init.checkpoint is what the run trains, or refused: a
    fresh head drops the checkpoint's pre-logits layer (the paper fine-tunes without one), and no
    run adds one to a checkpoint's weights."""
    asked = cfg.model.representation_size
    if asked is None or cfg.model.masked_patch_outputs is not None:  # (masked patch: refused by the config)
        return
    if cfg.init.reset_head:
        raise PreflightError(
            f"model.representation_size={asked} with init.checkpoint: a fine-tune's fresh head "
            "(init.reset_head=true) drops the checkpoint's pre-logits layer, and none is added to its weights; "
            "leave model.representation_size out"
        )
    if asked != held:
        holds = f"a pre-logits layer of {held}" if held else "no pre-logits layer"
        raise PreflightError(
            f"init.checkpoint {path} holds {holds}, but model.representation_size={asked}: fine-tuning keeps the "
            "checkpoint's architecture; leave model.representation_size out"
        )


def model_to_train(cfg: TrainingConfig, *, elsewhere_ok: bool = False) -> ModelConfig:
    """The model a run trains, refused (PreflightError) where it cannot be: ``cfg.model``, or with
    ``init.checkpoint`` the checkpoint's architecture at this run's resolution (a model.name, depth,
    head or pre-logits size set against it refused); built on the meta device. What `vitray finetune
    --dry-run` checks and prints, without the data. With ``elsewhere_ok`` a checkpoint that cannot be
    read from here (a cluster's path or store, as `vitray submit`'s dry-run meets it) leaves the
    config's model to check."""
    model = cfg.model
    if cfg.init.checkpoint:
        try:
            model = _check_init_checkpoint(cfg)
        except CheckpointNotHere:
            if not elsewhere_ok:
                raise
    check_model(model)
    return model


def check_model(model: ModelConfig, num_classes: int = 1) -> nn.Module:
    """The model builds at its configured size (what `--dry-run` checks without touching data);
    returns it, on the meta device (shapes only)."""
    try:
        with on_meta_device():  # shapes only: nothing allocated, nothing initialised
            return create_model_from_config(model, num_classes)
    except ValueError as err:
        raise PreflightError(f"model: {err}") from None

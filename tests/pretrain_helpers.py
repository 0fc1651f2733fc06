"""Running `vitray pretrain` as a user does (a subprocess with its own embedded Ray) in tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from vitray.runfolder.checkpoint_folders import STATE_FILE, CheckpointInfo, find_checkpoints, latest_complete_checkpoint

# A small, quick recipe: Ti/4 of 2 blocks at 16 px on digits, 2 CPU workers, fp32, ZeRO-1. Two
# blocks, not Ti's 12: the steps of the suite's end-to-end runs were most of their CPU (a 30-step
# run 148 CPU-s with 12 blocks, 62 with 2), and no behaviour they check needs more than two.
BASE = [
    "model.name=Ti/4",
    "model.depth=2",
    "model.img_size=16",
    "train.batch_size=32",
    "train.micro_batch_size=16",
    "optim.lr=0.001",
    "schedule.warmup_steps=3",
    "log.every=2",
    "checkpoint.keep=2",
    "precision.dtype=fp32",
    "train.zero_stage=1",
    "cluster.num_workers=2",
    "data.num_slots=8",
    "data.num_workers=1",
    "data.shuffle_buffer=64",
    "data.min_crop_area=0.5",  # 8x8 digits: small crops lose the label
    "data.flip=false",
]


def make_checkpoint(folder: Path, *, evals: dict | None = None, **model: object):
    """A complete one-rank checkpoint, as a run writes it, of a model (`ModelConfig` fields over a
    Ti/4 at 16 px, `depth` left to the variant's) with random values in every parameter: no training
    needed; its recorded config holds `evals` (the run's evaluators) where given. Returns the model,
    in eval mode."""
    import torch
    from safetensors.torch import save_file

    from vitray.models import ModelConfig, create_model_from_config
    from vitray.trainers.checkpoint import rank_files

    config = ModelConfig(**{"name": "Ti/4", "img_size": 16, **model})
    net = create_model_from_config(config, num_classes=10)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    folder.mkdir(parents=True)
    save_file(net.state_dict(), str(folder / rank_files.MODEL_FILE))
    state = {"step": 4, "world_size": 1, "num_classes": 10, "model": config.model_dump()}
    rank_files.write_state(folder, state if evals is None else {**state, "config": {"evals": evals}})
    rank_files.mark_complete(folder, 0, rank_files.files_under(folder))
    return net.eval()


# The uninterrupted run (the `reference_run` fixture) that runs killed, restarted, stopped by a
# signal or a full disk, drained or short of a node must end up equal to: 30 steps on whole digits,
# named `ref`. The checkpoint and pre-emption-check intervals do not change the weights (a resume is
# exact), so each module picks its own and all share the one run.
REFERENCE_NAME = "ref"
REFERENCE_STEPS = 30
REFERENCE = (f"train.steps={REFERENCE_STEPS}", "data.min_crop_area=1.0")

# For a run a test acts on while it runs (a signal, a kill, a full disk): a quarter second a step,
# so that its 30 steps last ~8 s instead of the few seconds they take (weights unchanged).
HELD = "debug.step_delay_s=0.25"


def steps_begun(keys: Path) -> int:
    """The steps the run's latest worker group has begun, from rank 0's sample keys in `keys` (a
    run's `debug.record_sample_keys`): rank 0 records each step's keys (numbered from 0) as the step
    begins, at once, where the metrics reach the run folder only every `log.upload_every_s` (10 s:
    20 held steps)."""
    files = sorted(keys.glob("keys-attempt*-rank0000.tsv"))  # named by the group's start time
    text = files[-1].read_text() if files else ""
    lines = text[: text.rfind("\n")].splitlines()  # whole lines only
    return int(lines[-1].split("\t")[0]) if lines else 0


def vitray_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "vitray.cli", *args]


def pretrain_args(dataset: str, storage: str, name: str, *extra: str, base: Sequence[str] = BASE) -> list[str]:
    sets = [*base, f"data.train={dataset}", f"run.storage={storage}", f"run.name={name}", *extra]
    return vitray_cmd("pretrain", *[a for s in sets for a in ("--set", s)])


# What the test process's own one-rank group (conftest's `process_group`) set in its environment: a
# command run from it gets none of it, as from a shell, whichever tests ran first in this worker.
TEST_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _as_a_shell_has_it(environ: dict) -> dict:
    return {name: value for name, value in environ.items() if name not in TEST_GROUP_ENV}


def run(
    cmd: list[str], timeout: float = 480, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end; one that outlives ``timeout`` fails with what it printed and where
    each of its Python processes (driver, Ray workers) stood, then is stopped with its embedded Ray."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_as_a_shell_has_it(os.environ), **(env or {})},
        cwd=cwd,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = python_stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} still running after {timeout:.0f} s:\n{stdout[-4000:]}\n{stderr[-4000:]}\n"
            f"where its processes stood:\n{stacks}"
        ) from None
    finally:
        _stop_leftover_ray(proc.pid)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{stdout[-3000:]}\n{stderr[-6000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def python_stacks(pid: int, limit: int = 30000) -> str:
    """Every thread's stack in ``pid`` and its Python descendants, by py-spy (which ships with
    ray[default]), for a run that hangs."""
    import psutil

    py_spy = Path(sys.executable).with_name("py-spy")
    try:
        run = psutil.Process(pid)
        procs = [run, *run.children(recursive=True)]
    except psutil.NoSuchProcess:
        return "(the run had already ended)"
    dumps = []
    for p in procs:
        try:
            if "python" not in p.name() and not p.name().startswith("ray::"):
                continue
            out = subprocess.run([str(py_spy), "dump", "--pid", str(p.pid)], capture_output=True, text=True, timeout=30)
            dumps.append(f"--- {p.pid} {' '.join(p.cmdline())[:160]}\n{out.stdout or out.stderr}")
        except (psutil.Error, subprocess.SubprocessError, OSError) as error:
            dumps.append(f"--- {p.pid}: no stack ({error})")
    return "\n".join(dumps)[-limit:]


def run_until_mid_checkpoint(cmd: list[str], run_dir: str, after_step: int, timeout: float = 480) -> CheckpointInfo:
    """Start a run whose checkpoints wait 5 s between their files and their completion records
    (`debug.checkpoint_record_delay_s`) and kill its whole process tree -- driver, embedded Ray,
    workers -- with SIGKILL in the middle of its first checkpoint after the complete one at
    `after_step` or later: its files in the folder (rank 0's trainer state among them), not all of
    its completion records. A pre-emption at the worst moment. Returns that unfinished checkpoint."""
    cmd = [*cmd, "--set", "debug.checkpoint_record_delay_s=5"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=_as_a_shell_has_it(os.environ),
    )
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            latest = latest_complete_checkpoint(run_dir) if Path(run_dir).exists() else None
            if latest is not None and latest.step >= after_step:
                unfinished = [
                    c
                    for c in find_checkpoints(run_dir)
                    if not c.complete and Path(c.path).name > Path(latest.path).name  # dated names
                    if (Path(c.path) / STATE_FILE).is_file()
                ]
                if unfinished:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    # Read again, after the kill: the listing above may predate the trainer state.
                    return next(c for c in find_checkpoints(run_dir) if c.path == unfinished[-1].path)
            if proc.poll() is not None:
                raise AssertionError(f"run ended before it could be stopped: {proc.stderr.read()[-3000:]}")
            time.sleep(0.1)
        raise AssertionError("no checkpoint in progress appeared in time")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _stop_leftover_ray(proc.pid)


def kill_ray_head(pid: int, process: str = "gcs_server") -> int:
    """SIGKILL a process of the embedded Ray head that the command `pid` started -- its GCS server,
    or its `raylet` -- found among the command's own descendants and killed by its pid (never
    another Ray on the machine); returns that pid."""
    import psutil

    (found,) = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == process]
    found.kill()
    return found.pid


def run_until_ray_dies(
    cmd: list[str], run_dir: str, min_step: int, timeout: float = 480
) -> subprocess.CompletedProcess:
    """Start a run and kill its embedded Ray's head (the GCS) as soon as a complete checkpoint at
    `min_step` or later exists; returns the command's outcome once it has exited by itself (its
    leftover processes are then killed with its session)."""
    with running(cmd) as proc:
        deadline = time.monotonic() + timeout
        while (latest := latest_complete_checkpoint(run_dir) if Path(run_dir).exists() else None) is None or (
            latest.step < min_step
        ):
            if proc.poll() is not None:
                raise AssertionError(f"run ended before Ray could be stopped: {proc.communicate()[1][-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("no checkpoint appeared in time")
            time.sleep(0.2)
        kill_ray_head(proc.pid)
        stdout, stderr = proc.communicate(timeout=120)  # Ray itself would end it after 60 s
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@contextmanager
def running(cmd: list[str]) -> Iterator[subprocess.Popen]:
    """``cmd`` started in a session of its own, its output piped as text; on leaving the block it
    is killed if it still runs, and its embedded Ray's leftovers are stopped."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=_as_a_shell_has_it(os.environ),
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _stop_leftover_ray(proc.pid)


def _stop_leftover_ray(session_id: int) -> None:
    """Processes of the killed session that outlived the kill: Ray daemons re-parented to init, and
    Ray's workers, which run in process groups of their own (in the command's session)."""
    with suppress(ProcessLookupError):
        os.killpg(session_id, signal.SIGKILL)
    for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()):
        with suppress(ProcessLookupError, PermissionError):
            if pid != os.getpid() and os.getsid(pid) == session_id:
                os.kill(pid, signal.SIGKILL)


def final_weights(run_dir: str) -> dict:
    """The consolidated weights of the run's latest complete checkpoint: its model.safetensors, or
    (a checkpoint before the run's last, checkpoint.model_weights=last) derived from its shards."""
    from vitray import storage
    from vitray.runfolder.checkpoint_folders import model_weights, read_state

    latest = latest_complete_checkpoint(run_dir)
    assert latest is not None, f"no complete checkpoint in {run_dir}: {find_checkpoints(run_dir)}"
    return model_weights(latest.path, storage.filesystem(latest.path)[0], latest.state or read_state(latest.path))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not bool((a[k] == b[k]).all())]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def in_process_loop(dataset, tmp_path: Path, *extra: str, restore_dir: Path | None = None, report=None):
    """A one-worker `TrainingLoop` built in this process (no Ray): Ti/4 of 2 blocks at 16 px, 4 steps of 8
    samples, bf16, ZeRO-1, logging at step 4, resuming from `restore_dir` if given. `report(metrics,
    checkpoint_dir)` gets each checkpoint (what Ray Train would upload). Needs the `process_group`
    fixture."""
    from vitray.common.config import load_config
    from vitray.trainers.config import TrainingConfig
    from vitray.trainers.context import WorkerContext
    from vitray.trainers.loop import TrainingLoop

    cfg = load_config(
        TrainingConfig,
        None,
        [
            f"data.train={dataset}",
            "model.img_size=16",
            "model.depth=2",
            "train.steps=4",
            "train.batch_size=8",
            "train.micro_batch_size=8",
            "schedule.warmup_steps=1",
            "log.every=4",
            "cluster.num_workers=1",
            "data.num_workers=0",
            "precision.dtype=bf16",
            "train.zero_stage=1",
            f"run.storage={tmp_path}",
            *extra,
        ],
    )
    ctx = WorkerContext(
        rank=0,
        world_size=1,
        run_dir=str(tmp_path / "run"),
        report=report or (lambda m, d: None),
        resume_from=str(restore_dir) if restore_dir is not None else None,
    )
    return TrainingLoop(cfg, ctx)


def straight_and_resumed(dataset, tmp_path: Path, *extra: str, between=None) -> tuple[dict, dict]:
    """The final weights of an `in_process_loop` run of `extra` (with `checkpoint.every` set) that went
    straight through, and of the same run resumed from its first checkpoint in a fresh loop
    (`between()` runs before the resume). Needs the `process_group` fixture."""
    from vitray.runfolder import checkpoint_folders as ckpt

    saved: dict[str, list[str]] = {"straight": [], "resumed": []}

    def keep(name):
        return lambda metrics, folder: saved[name].append(folder)

    in_process_loop(dataset, tmp_path / "straight", *extra, report=keep("straight")).run()
    if between is not None:
        between()
    restore = Path(saved["straight"][0])
    resumed = in_process_loop(dataset, tmp_path / "resumed", *extra, restore_dir=restore, report=keep("resumed"))
    assert resumed.step == ckpt.read_state(str(restore))["step"] > 0
    resumed.run()

    def weights(folder: str) -> dict:
        return ckpt.model_weights(folder, ckpt.storage.filesystem(folder)[0], ckpt.read_state(folder))

    return weights(saved["straight"][-1]), weights(saved["resumed"][-1])

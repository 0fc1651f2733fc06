"""What a short `vitray pretrain` costs beyond Ray Train itself: CPU seconds of a 4-step run of the
demo recipe (configs/demo.yaml: Ti/4 at 16 px on the built-in digits, two CPU workers, its val
evaluator) against a bare Ray Train V2 `TorchTrainer` with the same two workers doing only a
barrier, each a fresh process with its own local Ray instance, alternating in rounds.

The CPU of everything a command starts (its Ray instance, the workers, their loader processes) is
counted by putting the command in a cgroup of its own (v1 cpuacct, or v2 cpu.stat) where this
machine lets us (root); elsewhere by the command's reaped children (`RUSAGE_CHILDREN`), which misses
Ray processes that are not reaped by their parents. Prints CPU and wall seconds of each, their
medians and the ratio vitray / bare (issue 38's bar: <= 1.3).

A third command shows how much of the difference is the training itself: the bare job whose two
workers also build the demo's model (Ti/4 at 16 px, 10 classes), wrap it in DistributedDataParallel
and take the same number of plain `torch.optim.AdamW` steps on random micro-batches of the demo's
size (32) -- the least any Ray Train job that trains this model costs (no data, evaluation,
checkpoint, metrics or DeepSpeed). Its ratio to the bare job is printed, and vitray's to it.

    .venv/bin/python benchmarks/startup.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

BARE = """
import os, sys, tempfile
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
import ray, torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

def barrier():
    dist.barrier()

ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="warning")
TorchTrainer(
    barrier,
    scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
    run_config=RunConfig(name="bare", storage_path=sys.argv[1]),
).fit()
ray.shutdown()
"""


# The bare job, its workers training the demo's model with a plain loop (`{steps}`: how many steps).
PLAIN_LOOP = BARE.replace(
    """def barrier():
    dist.barrier()""",
    """def barrier():
    import torch
    from vitray.models import create_model_from_config
    from vitray.models.config import ModelConfig

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        create_model_from_config(ModelConfig(name="Ti/4", img_size=16), 10)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for _ in range({steps}):
        images, labels = torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.barrier()""",
).replace('name="bare"', 'name="loop"')
assert PLAIN_LOOP != BARE


class CpuMeter:
    """CPU seconds of one command and everything it starts."""

    def __init__(self):
        self.kind, self.root = "rusage", None
        for kind, root in (
            ("cgroup v1", Path("/sys/fs/cgroup/cpuacct")),
            ("cgroup v2", Path("/sys/fs/cgroup/unified")),
        ):
            probe = root / f"vitray-startup-{uuid.uuid4().hex[:8]}"
            try:
                probe.mkdir()
                probe.rmdir()
            except OSError:
                continue
            self.kind, self.root = kind, root
            break

    def run(self, command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
        """(CPU seconds, wall seconds, output) of `command`, which must succeed."""
        group = self.root / f"vitray-startup-{uuid.uuid4().hex[:8]}" if self.root else None
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        if group is not None:
            group.mkdir()
            # The child moves itself into the group before it execs: all it starts is counted there.
            join = f'echo $$ > {group}/cgroup.procs && exec "$@"'
            command = ["sh", "-c", join, "sh", *command]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            wall = time.perf_counter() - start
            if done.returncode != 0:
                raise RuntimeError(f"{command[-8:]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            if group is None:
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            else:
                cpu = self._group_cpu(group)
        finally:
            if group is not None:
                self._remove(group)
        return cpu, wall, done.stdout + done.stderr

    def _group_cpu(self, group: Path) -> float:
        # Processes the command left behind (Ray's, on their way out) are waited for: their CPU counts.
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.kind == "cgroup v1":
            return int((group / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    @staticmethod
    def _remove(group: Path) -> None:
        for _ in range(50):
            try:
                group.rmdir()
                return
            except OSError:  # a straggler still in it
                time.sleep(0.2)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    meter = CpuMeter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    python = sys.executable
    results: dict[str, list[tuple[float, float]]] = {"vitray": [], "bare": [], "loop": []}
    with tempfile.TemporaryDirectory(prefix="vitray-startup-") as tmp:
        data = Path(tmp) / "digits"
        subprocess.run(
            [python, "-m", "vitray.cli", "data", "prepare", "builtin:digits", str(data)],
            check=True,
            capture_output=True,
            env=env,
        )
        for round_ in range(args.rounds):
            storage = Path(tmp) / f"runs-{round_}"
            sets = [
                f"data.train={data}",
                f"run.storage={storage}",
                f"run.name=r{round_}",
                f"train.steps={args.steps}",
                f"checkpoint.every={args.steps}",
                "schedule.warmup_steps=1",
                "log.every=2",
            ]
            recipe = str(REPO / "configs" / "demo.yaml")
            vitray = [python, "-m", "vitray.cli", "pretrain", "-c", recipe, *[a for v in sets for a in ("--set", v)]]
            bare = [python, "-c", BARE, str(Path(tmp) / f"bare-{round_}")]
            loop = [python, "-c", PLAIN_LOOP.replace("{steps}", str(args.steps)), str(Path(tmp) / f"loop-{round_}")]
            order = [("vitray", vitray), ("bare", bare), ("loop", loop)]
            order = order[round_ % 3 :] + order[: round_ % 3]  # each command first in some round
            for name, command in order:
                cpu, wall, _ = meter.run(command, env)
                results[name].append((cpu, wall))
                print(f"round {round_ + 1} {name}: {cpu:.1f} CPU-s, {wall:.1f} s wall", flush=True)
    cpu = {name: statistics.median(c for c, _ in rows) for name, rows in results.items()}
    wall = {name: statistics.median(w for _, w in rows) for name, rows in results.items()}
    print(
        f"median of {args.rounds} (CPU counted by {meter.kind}): vitray {args.steps}-step demo run "
        f"{cpu['vitray']:.1f} CPU-s ({wall['vitray']:.1f} s wall), bare TorchTrainer barrier {cpu['bare']:.1f} CPU-s "
        f"({wall['bare']:.1f} s wall)"
    )
    print(f"plain training loop {cpu['loop']:.1f} CPU-s ({wall['loop']:.1f} s wall)")
    print(f"vitray/bare CPU: {cpu['vitray'] / cpu['bare']:.2f}; wall: {wall['vitray'] / wall['bare']:.2f}")
    print(f"loop/bare CPU: {cpu['loop'] / cpu['bare']:.2f}; vitray/loop CPU: {cpu['vitray'] / cpu['loop']:.2f}")
    return {"vitray_cpu_s": cpu["vitray"], "bare_cpu_s": cpu["bare"], "ratio": cpu["vitray"] / cpu["bare"]}


if __name__ == "__main__":
    main()

"""`vitray submit`: run a vitray command as a Ray job through the Jobs API, and follow its logs.

Ctrl-C stops following; the job keeps running (`ray job stop ID` stops it: a SIGTERM to the driver,
which checkpoints and stops within `run.preemption_grace_s`, given that long by `runtime_env`).
"""

from __future__ import annotations

import asyncio
import math
import os
import shlex
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from vitray.cluster.runtime import RayUnavailable, enable_token_auth_if_available
from vitray.common import exit_codes, redact

# What never belongs in a job's uploaded working dir (gitignore patterns; a leading / anchors one to
# the folder's top, so that `configs/runs/x.yaml` goes along): tools' folders, run outputs, data and
# weights -- and the secrets a project folder often holds, since the package is stored on the cluster.
WORKING_DIR_EXCLUDES = [
    ".git",
    ".venv",
    "**/__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".gpu-kit",
    "/runs",
    "/demo-output",
    "wandb",
    "mlruns",
    "*.tar",
    "*.npz",
    "*.safetensors",
    "*.pt",
    "*.pth",
    ".env*",
    ".aws",
    ".ssh",
    ".netrc",
    "id_rsa*",
    "id_ed25519*",
    "*.pem",
    "*.key",
    "*credentials*",
]

# Forwarded to the job when set on the submitting machine: where the storage is, never who may
# read it. A job's runtime_env is stored with the job and shown to anyone who can list jobs
# (`ray job list`, the Jobs API, the dashboard), so credentials never go there; the cluster's nodes
# get their own (an instance profile, IRSA, or a Kubernetes Secret: deploy/, docs/deploy.md "Credentials").
FORWARDED_ENV = (
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)
# Secrets a user's shell often holds, named in the note that they were not forwarded.
NOT_FORWARDED_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


# `ray job stop` sends the driver SIGTERM and SIGKILLs it RAY_JOB_STOP_WAIT_TIME_S later (Ray's
# default: 3 s), long before its workers can checkpoint: the job waits the run's grace period and
# this much more (the driver records the attempt and releases the run's lease after the workers stop).
STOP_MARGIN_S = 60.0
STOP_WAIT_VARIABLE = "RAY_JOB_STOP_WAIT_TIME_S"


def runtime_env(working_dir: str | None, env: dict[str, str], args: list[str] = ()) -> dict[str, Any]:
    env_vars = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    env_vars[STOP_WAIT_VARIABLE] = str(math.ceil(grace_s(args) + STOP_MARGIN_S))
    env_vars.update(env)
    runtime: dict[str, Any] = {"env_vars": env_vars}
    if working_dir:
        runtime["working_dir"] = working_dir
        runtime["excludes"] = WORKING_DIR_EXCLUDES
    return runtime


def grace_s(args: list[str]) -> float:
    """The submitted command's `run.preemption_grace_s`: its last `--set` of it, else the default
    (a config file's own value is not read here: pass `--env RAY_JOB_STOP_WAIT_TIME_S=S` for a longer one)."""
    from vitray.trainers.config import RunConfig

    key = "run.preemption_grace_s="
    given = [arg.removeprefix("--set=").removeprefix(key) for arg in args if arg.removeprefix("--set=").startswith(key)]
    try:
        return float(given[-1]) if given else float(RunConfig.model_fields["preemption_grace_s"].default)
    except ValueError:  # not a number: the command itself refuses it (its --dry-run here, or on the cluster)
        return float(RunConfig.model_fields["preemption_grace_s"].default)


class NotSubmitted(ValueError):
    """The submitted command's own --dry-run refused it here: it would have failed on the cluster."""


def submit(address: str, args: list[str], *, working_dir: str | None, env: dict[str, str], follow: bool) -> str:
    """Submit `vitray ARGS...` as a Ray job to the Jobs API at `address` and, with `follow`, print
    its logs until it ends (exiting with the driver's exit code when it did not succeed).

    Raises :class:`NotSubmitted` when the command's --dry-run fails here (:func:`check_here`)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    refuse_credentials(args)
    check_here(args, working_dir)
    for line in env_notices(env):
        print(line, file=sys.stderr)
    enable_token_auth_if_available()
    address = _with_scheme(address)
    try:
        client = JobSubmissionClient(address)
    except Exception as error:  # ConnectionError; a GCS address that never answers: Ray's RpcError
        raise RayUnavailable(_no_jobs_api(address)) from error
    entrypoint = "vitray " + shlex.join(args)
    job_id = _submit_when_ready(client, entrypoint, runtime_env(working_dir, env, args))
    print(f"submitted job {job_id}: {entrypoint}", file=sys.stderr)
    stop = f"`{_ray_job_command('stop', job_id, address)}` stops it"
    if not follow:
        print(job_id)  # stdout: JOB=$(vitray submit --no-follow ...)
        return job_id
    try:
        asyncio.run(_tail(client, job_id))
    except KeyboardInterrupt:
        print(f"\ndetached; job {job_id} keeps running ({stop})", file=sys.stderr)
        return job_id
    except Exception as error:  # the head went away under the log stream (a closed WebSocket)
        raise RayUnavailable(
            f"lost the log stream of job {job_id} ({type(error).__name__}: {error}); the head node may be gone. "
            f"`{_ray_job_command('status', job_id, address)}` says how the job ended; submitting the same command "
            "again resumes its run"
        ) from error
    info = client.get_job_info(job_id)
    print(f"job {job_id}: {describe_end(info.status.value, info.driver_exit_code)}", file=sys.stderr)
    if info.status != JobStatus.SUCCEEDED:
        # The driver's own exit code when it has one (75: pre-empted, 130: stopped by user), so that
        # whatever runs `vitray submit` can tell a pre-emption from a failure; a job stopped with
        # `ray job stop` has none (Ray records STOPPED): it was stopped by a user.
        stopped = info.status == JobStatus.STOPPED and info.driver_exit_code is None
        raise SystemExit(exit_codes.STOPPED_BY_USER if stopped else info.driver_exit_code or 1)
    return job_id


def _ray_job_command(verb: str, job_id: str, address: str) -> str:
    """The `ray job` command line that reaches this job as vitray did (token auth where vitray turned it on)."""
    auth = "RAY_AUTH_MODE=token " if os.environ.get("RAY_AUTH_MODE") == "token" else ""
    return f"{auth}ray job {verb} --address {address} {job_id}"


def _with_scheme(address: str) -> str:
    """`HOST:PORT` of a dashboard (the Jobs API) as `http://HOST:PORT`: without a scheme Ray takes it for
    a GCS address and waits ~40 s for a GCS that is not there. Anything else (a GCS address, `auto`,
    `ray://`, `http(s)://`) as given."""
    if "://" in address or ":" not in address:
        return address
    try:
        urllib.request.urlopen(f"http://{address}/api/version", timeout=3)
    except urllib.error.HTTPError:  # an HTTP server answered (401 without the token): the dashboard
        pass
    except urllib.error.URLError as error:
        if isinstance(error.reason, (ConnectionRefusedError, TimeoutError)):
            # Nothing listens there (or nothing answers): neither a dashboard nor a GCS, and Ray would
            # wait ~40 s for one, printing its own C++ warnings, before the same refusal.
            raise RayUnavailable(_no_jobs_api(address)) from None
        return address
    except (OSError, ValueError):  # something answered, not over HTTP: a GCS address, as given
        return address
    return f"http://{address}"


def _no_jobs_api(address: str) -> str:
    return (
        f"no Ray Jobs API answers at {address}: give --address (or RAY_ADDRESS) as the head node's dashboard "
        "address, http://HOST:8265, and check that the cluster is up (`ray status` on its head node)"
    )


def refuse_credentials(args: list[str]) -> None:
    """Refuse (NotSubmitted) a command line that carries a credential (`common.redact.redact_args`: a
    `--set` of a secret-looking key or a mapping holding one, a URL with a password, the value of a
    secret-looking variable of this shell): the job's entrypoint is stored with the job and shown to
    anyone who can list jobs."""
    found = [masked for arg, masked in zip(args, redact.redact_args(args), strict=True) if masked != arg]
    if found:
        raise NotSubmitted(
            f"not submitted: {', '.join(found)} would be stored in the Ray job's entrypoint, which anyone who "
            "can list jobs can read; give the cluster's nodes their own credentials (docs/deploy.md, Credentials), "
            "or on a throw-away cluster pass them with --env NAME=VALUE"
        )


# Commands whose --dry-run validates the config (and, for pretrain, that the model builds).
DRY_RUNNABLE = ("pretrain", "finetune", "evaluate")


def check_here(args: list[str], working_dir: str | None) -> None:
    """The submitted command's own --dry-run, here and in seconds, so that a config mistake is
    refused before the job reaches the cluster. Only with `working_dir`: then the job sees the
    same files (without it, paths are the cluster image's, which this machine may not have)."""
    import subprocess

    if working_dir is None or args[0] not in DRY_RUNNABLE or "--dry-run" in args:
        return
    checked = subprocess.run(
        [sys.executable, "-m", "vitray.cli", *args, "--dry-run"], cwd=working_dir, capture_output=True, text=True
    )
    if checked.returncode != 0:
        said = [line for line in checked.stderr.splitlines() if line.strip()]
        reason = "\n".join(said[-5:]).removeprefix("error: ") or f"exit code {checked.returncode}"
        raise NotSubmitted(f"not submitted: `vitray {' '.join(args)}` would fail: {reason}")


# The driver's exit codes that are not failures of the work.
_STOPPED = {
    exit_codes.PREEMPTED: "pre-empted (stopped after a checkpoint; submit it again to resume)",
    exit_codes.STOPPED_BY_USER: "stopped by user (Ctrl-C; submit it again to resume)",
    exit_codes.GRACE_RAN_OUT: "pre-empted before a checkpoint (submit it again to resume from the latest one)",
}


def describe_end(status: str, driver_exit_code: int | None) -> str:
    """How a followed job ended: Ray's status, or what the driver's exit code says."""
    if status == "FAILED" and driver_exit_code in _STOPPED:
        return _STOPPED[driver_exit_code]
    if status == "STOPPED" and driver_exit_code is None:
        return "STOPPED (ray job stop: its run checkpoints at its next check step within its grace; submit it again to resume)"
    return status if driver_exit_code in (None, 0) else f"{status} (exit code {driver_exit_code})"


def env_notices(env: dict[str, str]) -> list[str]:
    """What the user should know about the job's environment: explicit --env values are readable in
    the job record; the shell's AWS credentials are not forwarded."""
    notices = []
    if env:
        notices.append(
            f"vitray: warning: --env {', '.join(sorted(env))} is stored in the Ray job's runtime_env, which anyone "
            "who can list jobs can read (ray job list, the dashboard); give credentials to the cluster's nodes "
            "instead (docs/deploy.md, Credentials)"
        )
    skipped = [name for name in NOT_FORWARDED_SECRETS if name in os.environ and name not in env]
    if skipped:
        notices.append(
            f"vitray: {', '.join(skipped)} from this shell are not forwarded to the job (its runtime_env is "
            "readable by anyone who can list jobs); the cluster's nodes use their own credentials"
        )
    return notices


def _submit_when_ready(client, entrypoint: str, runtime: dict[str, Any], wait_s: float = 120.0) -> str:
    """Submit, waiting out a head node that is up but whose job agent is not yet (fresh clusters)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime)
        except RuntimeError as err:
            if "No available agent" not in str(err):
                raise
            if time.monotonic() > deadline:
                raise RayUnavailable(
                    f"the Ray cluster answers but has no job agent after {wait_s:.0f} s, so it takes no jobs: its "
                    "dashboard agent could not serve HTTP, most often because its port (52365 unless `ray start "
                    "--dashboard-agent-listen-port` set another) is taken by another Ray instance or program on the "
                    "head node; see dashboard_agent.log in the head's Ray session logs"
                ) from err
            time.sleep(2)


async def _tail(client, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):
        print(lines, end="", flush=True)

"""`vitray submit` against a real `ray start --head` cluster on 127.0.0.1 (token auth on)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ports import free_port
from pretrain_helpers import BASE, steps_begun

from vitray.data import read_dataset_info
from vitray.runfolder.checkpoint_folders import latest_complete_checkpoint
from vitray.runfolder.files import RunFiles

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head node started the way users start one, stopped (whole process group) after."""
    port, dashboard = free_port(), free_port()
    # Ray's socket paths live under the temp dir and must stay under the 107-byte socket limit.
    temp_dir = tempfile.mkdtemp(prefix="vr", dir="/tmp")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            # The job agent's HTTP port on a port of its own: at Ray's fixed default (52365) it loses
            # to any other Ray instance on the machine (the suite runs two at once), and a head whose
            # agent could not bind refuses every job ("No available agent to submit job").
            "--dashboard-agent-listen-port=0",
            "--num-cpus=2",
            "--include-dashboard=true",
            f"--temp-dir={temp_dir}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_jobs_api(address, head)
        yield address
    finally:
        _stop(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop(head: subprocess.Popen) -> None:
    try:
        # A short grace, then SIGKILL: a graceful `ray stop` of the head takes ~30 s, and nothing
        # of this throw-away cluster needs saving.
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=3)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)  # daemons left in the session
    head.wait()


def _wait_for_jobs_api(address: str, head: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise AssertionError(f"ray start failed: {head.stderr.read()[-3000:]}")
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:  # answering (401 without the token): it is up
            return
        except OSError:
            time.sleep(1)
    raise AssertionError("the Ray Jobs API did not come up")


# Credentials as a user's shell holds them (made up): none may reach the job record.
SHELL_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAVITRAYTESTKEY123",
    "AWS_SECRET_ACCESS_KEY": "vitray-test-secret-must-not-leak",
    "AWS_SESSION_TOKEN": "vitray-test-session-token-must-not-leak",
}


LIST_JOBS = """
import json, sys
from ray.job_submission import JobSubmissionClient
print(json.dumps([job.dict() for job in JobSubmissionClient(sys.argv[1]).list_jobs()], default=str))
"""


def _job_record(address: str, job_id: str) -> dict:
    """The job as anyone who can list jobs sees it (the Jobs API behind `ray job list`), asked from
    a process of its own: token auth must be on before `ray` is imported, which this one may have done."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    out = subprocess.run(
        [sys.executable, "-c", LIST_JOBS, address], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (job,) = [job for job in json.loads(out.stdout.splitlines()[-1]) if job["submission_id"] == job_id]
    return job


def _job_id(stderr: str) -> str:
    return stderr.split("submitted job ", 1)[1].split(":", 1)[0]


def test_submit_runs_a_vitray_command_as_a_ray_job(ray_head, tmp_path):
    dest = tmp_path / "digits"
    env = {**os.environ, **SHELL_CREDENTIALS, "AWS_REGION": "eu-west-1"}
    out = subprocess.run(
        [
            str(BIN / "vitray"),
            "submit",
            "--address",
            ray_head,
            "--",
            "data",
            "prepare",
            "builtin:digits",
            str(dest),
            "--serial",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "submitted job" in out.stderr and "SUCCEEDED" in out.stderr
    # The shell's credentials stay out of the job record; the region (not a secret) goes along.
    job = _job_record(ray_head, _job_id(out.stderr))
    record = json.dumps(job)
    for name, value in SHELL_CREDENTIALS.items():
        assert value not in record and name not in job["runtime_env"]["env_vars"], name
    assert job["runtime_env"]["env_vars"]["AWS_REGION"] == "eu-west-1"
    assert "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN from this shell are not forwarded" in " ".join(
        out.stderr.split()
    )
    followed = " ".join((out.stdout + out.stderr).split())  # the job's own output, followed
    assert "digits, 10 classes" in followed
    info = read_dataset_info(str(dest))
    assert info.splits["train"].num_samples + info.splits["test"].num_samples == 1797


def test_ray_job_stop_checkpoints_the_run_and_the_submit_says_so(ray_head, digits_dataset, tmp_path):
    """`ray job stop` is a SIGTERM to the driver, which Ray follows with a SIGKILL 3 s later unless the
    job's runtime env says otherwise: the job vitray submits waits the run's grace, so the run
    checkpoints at its next check step, records a stopped attempt and releases its lease; the followed
    submit says it stopped and exits 130."""
    keys = tmp_path / "keys"
    sets = [
        *BASE,
        "cluster.num_workers=1",
        f"data.train={digits_dataset}",
        f"run.storage={tmp_path}",
        "run.name=stopped",
        "train.steps=2000",
        "checkpoint.every=1000",
        "debug.step_delay_s=0.2",
        "debug.checkpoint_record_delay_s=6",  # a checkpoint that takes longer than Ray's 3 s
        f"debug.record_sample_keys={keys}",
    ]
    command = [str(BIN / "vitray"), "submit", "--address", ray_head, "--", "pretrain"]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: a pipe nobody reads could fill up
        follow = subprocess.Popen(
            [*command, *[a for s in sets for a in ("--set", s)]], stdout=stdout, stderr=stderr, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while steps_begun(keys) < 3:
            assert follow.poll() is None and time.monotonic() < deadline, err.read_text()[-4000:]
            time.sleep(1)
        stopped_at = steps_begun(keys)
        job_id = _job_id(err.read_text())
        env = {**os.environ, "RAY_AUTH_MODE": "token"}
        stop = subprocess.run(
            [str(BIN / "ray"), "job", "stop", "--address", ray_head, job_id], capture_output=True, text=True, env=env
        )
        assert stop.returncode == 0, stop.stderr[-3000:]
        follow.wait(timeout=240)
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
    stderr = err.read_text()
    said = " ".join(stderr.split())
    assert follow.returncode == 130, said[-3000:]
    assert f"job {job_id}: STOPPED (ray job stop" in said
    run_dir = str(tmp_path / "stopped")
    (attempt,) = RunFiles(run_dir).read_attempts()
    assert attempt["status"] == "stopped" and "SIGTERM" in attempt["error"], attempt
    checkpoint = latest_complete_checkpoint(run_dir)
    assert checkpoint is not None and stopped_at <= checkpoint.step < 1000  # the stop's own checkpoint
    assert not Path(RunFiles(run_dir).lease_path).exists()  # released: the same command resumes at once
    assert _job_record(ray_head, job_id)["runtime_env"]["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "90"


def test_submit_refuses_what_would_fail_on_the_cluster_before_connecting():
    """A leading `vitray` (the habit of `ray job submit -- vitray ...`) and a misspelt command are
    refused here, in one line, before any connection (nothing listens at the address)."""
    from typer.testing import CliRunner

    from vitray.cli.main import app

    for args, said in [
        (["vitray", "runs", "x"], "the command after -- is without `vitray`: vitray submit ... -- runs x"),
        (["pretrian", "-c", "x.yaml"], "'pretrian' is not a vitray command; the commands are: data, demo,"),
    ]:
        result = CliRunner().invoke(app, ["submit", "--address", "http://127.0.0.1:9", "--", *args])
        assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output


def test_a_dashboard_address_without_a_scheme_is_taken_as_one():
    """Without `http://` Ray takes HOST:PORT for a GCS address and waits ~40 s for one; a dashboard
    (any HTTP server, 401 without the token) answering there is reached as http://HOST:PORT."""
    import http.server
    import threading

    from vitray.cluster.submit import _with_scheme

    class Unauthorized(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Unauthorized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert _with_scheme(f"127.0.0.1:{port}") == f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
    closed = free_port()  # nothing listens: neither a dashboard nor a GCS (Ray waited ~40 s for one)
    from vitray.cluster.runtime import RayUnavailable

    with pytest.raises(RayUnavailable, match=f"no Ray Jobs API answers at 127.0.0.1:{closed}"):
        _with_scheme(f"127.0.0.1:{closed}")
    for given in ("auto", "ray://127.0.0.1:10001", "http://127.0.0.1:8265"):
        assert _with_scheme(given) == given


def test_runtime_env_forwards_settings_never_credentials(monkeypatch):
    from vitray.cluster.submit import env_notices, runtime_env

    for name, value in {**SHELL_CREDENTIALS, "AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://s3.local"}.items():
        monkeypatch.setenv(name, value)
    env_vars = runtime_env(None, {})["env_vars"]
    # ... and how long `ray job stop` waits for the driver: the run's grace (30 s unless --set) and a minute
    assert env_vars == {
        "AWS_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://s3.local",
        "RAY_JOB_STOP_WAIT_TIME_S": "90",
    }
    given = ["pretrain", "--set", "run.preemption_grace_s=300"]
    assert runtime_env(None, {}, given)["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "360"
    assert runtime_env(None, {"RAY_JOB_STOP_WAIT_TIME_S": "5"}, given)["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "5"
    (note,) = env_notices({})
    assert "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN from this shell are not forwarded" in note
    # Given explicitly, a variable goes along, with a warning; a credential named by --env is not "skipped".
    explicit = {"AWS_ACCESS_KEY_ID": "AKIAEXPLICIT"}
    assert runtime_env(None, explicit)["env_vars"]["AWS_ACCESS_KEY_ID"] == "AKIAEXPLICIT"
    warning, note = env_notices(explicit)
    assert warning.startswith("vitray: warning: --env AWS_ACCESS_KEY_ID is stored in the Ray job's runtime_env")
    assert note.startswith("vitray: AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN from this shell")
    assert "(docs/deploy.md, Credentials)" in warning


def test_the_uploaded_working_dir_leaves_out_outputs_and_secrets(tmp_path):
    """What `--working-dir` uploads, packed by Ray's own code with vitray's excludes: the configs go
    along; run outputs, weights and the files that usually hold secrets (`.env*`: `.envrc` too) do not."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    from vitray.cluster.submit import runtime_env

    kept = ["configs/run.yaml", "configs/runs/x.yaml", "grid.yaml", "environment.yaml"]
    left_out = [".env", ".env.local", ".envrc", ".aws/credentials", "runs/demo/metrics.jsonl", "w.safetensors"]
    for name in kept + left_out:
        (tmp_path / "project" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "project" / name).write_text("x")
    package = tmp_path / "package.zip"
    excludes = runtime_env(str(tmp_path / "project"), {})["excludes"]
    create_package(str(tmp_path / "project"), package, include_gitignore=True, excludes=excludes)
    with zipfile.ZipFile(package) as packed:
        uploaded = {name for name in packed.namelist() if not name.endswith("/")}
    assert uploaded == set(kept)


def test_failed_job_fails_the_submit(ray_head, tmp_path):
    # An explicit --env still reaches the job, with a warning that the job record shows it.
    out = subprocess.run(
        [
            str(BIN / "vitray"),
            "submit",
            "--address",
            ray_head,
            "--env",
            "VITRAY_TEST_SETTING=on",
            "--",
            "data",
            "prepare",
            "nosuch:x",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2  # the driver's own exit code (a refused input), passed on
    assert "FAILED (exit code 2)" in out.stderr
    warning = " ".join(out.stderr.split())
    assert "warning: --env VITRAY_TEST_SETTING is stored in the Ray job's runtime_env" in warning
    assert _job_record(ray_head, _job_id(out.stderr))["runtime_env"]["env_vars"]["VITRAY_TEST_SETTING"] == "on"


def test_a_job_that_stopped_is_reported_by_what_its_exit_code_means():
    from vitray.cluster.submit import describe_end

    assert describe_end("FAILED", 75).startswith("pre-empted (stopped after a checkpoint")
    assert describe_end("FAILED", 130).startswith("stopped by user")
    assert describe_end("FAILED", 1) == "FAILED (exit code 1)"
    assert describe_end("SUCCEEDED", 0) == "SUCCEEDED"


def test_a_command_line_that_carries_a_credential_is_not_submitted(monkeypatch):
    """The job's entrypoint is readable by anyone who can list jobs: a --set of a secret-looking key (or
    a mapping holding one), a URL with a password, the shell's secret values are refused before any
    connection; storage options that are not secrets go through."""
    from vitray.cluster.submit import NotSubmitted, refuse_credentials

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG")
    for args, named in [
        (["pretrain", "--set", "data.storage_options.secret=abcdef"], "not submitted: data.storage_options.secret=***"),
        (["pretrain", "--set=data.storage_options.client_kwargs.aws_secret_access_key=x"], "aws_secret_access_key=***"),
        (["evaluate", "ckpt", "--set", 'storage_options={"key": "AKIA", "secret": "s"}'], "storage_options=***"),
        (["data", "prepare", "hf:https://me:hunter2@hub.example/x", "out"], "hf:https://me:***@hub.example/x"),
        (["pretrain", "--set", "data.train=s3://b/wJalrXUtnFEMI/K7MDENG"], "data.train=s3://b/***"),
        (["demo", "--grid-set", "storage_options={key: AKIDx, secret: sssss}"], "storage_options=***"),
        (["demo", "--grid-set=finetune.overrides.data.storage_options.key=AKIDx"], "storage_options.key=***"),
    ]:
        with pytest.raises(NotSubmitted, match="would be stored in the Ray job's entrypoint") as refused:
            refuse_credentials(args)
        said = str(refused.value)
        assert named in said and not any(s in said for s in ("abcdef", "AKIA", "hunter2", "wJalrXUtnFEMI")), said
    refuse_credentials(
        ["pretrain", "--set", "data.storage_options.endpoint_url=http://s3.local", "--set", "model.head=token"]
    )


def test_a_command_that_would_fail_is_not_submitted(tmp_path):
    from typer.testing import CliRunner

    from vitray.cli.main import app

    (tmp_path / "run.yaml").write_text("data: {train: /data/x}\nmodel: {name: Ti/16, img_size: 30}\n")
    # Nothing listens at the address: the refusal comes before any connection is tried.
    result = CliRunner().invoke(
        app,
        [
            "submit",
            "--address",
            "http://127.0.0.1:9",
            "--working-dir",
            str(tmp_path),
            "--",
            "pretrain",
            "-c",
            "run.yaml",
        ],
    )
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "not submitted: `vitray pretrain -c run.yaml` would fail" in message
    assert "img_size 30 is not divisible by the patch size 16" in message


def test_an_address_where_no_jobs_api_answers_is_one_line():
    # A process of its own: `vitray submit` switches on Ray's token auth in its environment when a
    # token file exists (the ray_head fixture's cluster leaves one), which would leak into later
    # tests' Ray instances if run in this one. Port 9 (discard): nothing listens there.
    out = subprocess.run(
        [str(BIN / "vitray"), "submit", "--address", "http://127.0.0.1:9", "--", "data", "prepare", "builtin:x", "out"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.startswith("error: no Ray Jobs API answers at http://127.0.0.1:9:"), out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    # Without a scheme, nothing listening: Ray took it for a GCS address and waited ~40 s for it,
    # printing its C++ warnings, before the same line.
    started = time.monotonic()
    out = subprocess.run(
        [str(BIN / "vitray"), "submit", "--address", "127.0.0.1:9", "--", "data", "prepare", "builtin:x", "out"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: no Ray Jobs API answers at 127.0.0.1:9:"), out.stderr
    assert time.monotonic() - started < 20 and "rpc_client" not in out.stderr

"""Shard writing fanned out as Ray tasks gives exactly what the serial preparation gives."""

from __future__ import annotations

import re

import numpy as np
import pytest
import ray

from vitray.cluster.prepare import prepare_dataset_on_ray
from vitray.data import read_dataset_info


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():  # another module's Ray instance: use it, leave it running
        yield
        return
    # A private instance: without an address Ray would join another test's `ray start` cluster
    # running on this machine at the same time (the suite runs on two workers).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_ray_prepare_equals_serial_prepare(local_ray, digits_dataset, tmp_path, capsys):
    dest = tmp_path / "digits"
    info = prepare_dataset_on_ray("builtin:digits", str(dest), samples_per_shard=100)
    assert info == read_dataset_info(str(digits_dataset))
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == {
        p.name: p.read_bytes() for p in digits_dataset.iterdir()
    }
    # The progress counted every image: on stderr, as a plain line where there is no terminal.
    assert "preparing digits: 1,797/1,797 images (100%)" in capsys.readouterr().err

    prepare_dataset_on_ray("builtin:digits", str(dest))
    assert "already prepared" in capsys.readouterr().out


@pytest.mark.slow
def test_ray_prepare_treats_bad_images_like_the_serial_one(local_ray, tmp_path, capsys):
    from test_cli_prepare_refusals import image_folder, with_bad_images

    from vitray.data import BadImagesError, prepare_dataset, read_manifest

    src = image_folder(tmp_path / "src")
    bad = with_bad_images(src)
    with pytest.raises(BadImagesError) as on_ray:
        prepare_dataset_on_ray(f"imagefolder:{src}", str(tmp_path / "ray"), samples_per_shard=3, show_progress=False)
    with pytest.raises(BadImagesError) as serial:
        prepare_dataset(f"imagefolder:{src}", str(tmp_path / "serial"), samples_per_shard=3)
    assert str(on_ray.value) == str(serial.value) and str(bad[0]) in str(on_ray.value)
    assert not (tmp_path / "ray" / "dataset.json").exists()

    for dest, prepare in (("ray", prepare_dataset_on_ray), ("serial", prepare_dataset)):
        capsys.readouterr()
        prepare(f"imagefolder:{src}", str(tmp_path / dest), samples_per_shard=3, bad_images="skip")
        assert "skipped 2 bad images" in capsys.readouterr().out
    assert read_manifest(str(tmp_path / "ray"), "train") == read_manifest(str(tmp_path / "serial"), "train")

    # Another error a shard task raises (a table's row without its label): the task's own, as the
    # serial path raises it, not Ray's wrapper with the worker's traceback (which reached the console).
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_data_prepare import png_bytes

    (tmp_path / "table").mkdir()
    image = {"bytes": png_bytes(np.zeros((4, 4, 3), np.uint8)), "path": "a.png"}
    pq.write_table(
        pa.table({"image": pa.array([image] * 6), "label": [0, 1, 0, None, 1, 0]}), tmp_path / "table" / "train.parquet"
    )
    errors = []
    for dest, prepare in (("ray2", prepare_dataset_on_ray), ("serial2", prepare_dataset)):
        with pytest.raises(ValueError, match="train.parquet row 3 has no label") as raised:
            prepare(f"parquet:{tmp_path / 'table'}", str(tmp_path / dest), samples_per_shard=3, bad_images="skip")
        errors.append(raised.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]) and "ray::" not in str(errors[0])


def assert_gone_with(pgid: int, wait_s: float = 30.0) -> None:
    """Every process of the stopped command's process group (Ray's own, started by it) is gone
    within `wait_s`; those left are killed (by the group's id) and the test fails."""
    import os
    import signal
    import time

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError(f"processes of the stopped command were still running {wait_s:.0f} s after it exited")


@pytest.mark.slow
@pytest.mark.parametrize("signame, serial", [("SIGINT", False), ("SIGTERM", False), ("SIGTERM", True)])
def test_a_stop_during_a_ray_prepare_is_one_line_and_no_dataset(signame, serial, tmp_path):
    """Ctrl-C (the terminal signals the whole process group) while Ray tasks write shards: exit 130
    and the one line, every try (it once crashed in Ray's _raylet.so on exit); SIGTERM to the command
    (a scheduler's stop): exit 143 and its line, not Ray's stack dump and abort (with `--serial` too:
    it exited 143 saying nothing). The destination is never taken for a prepared dataset, and no
    process of the command outlives it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    dest = tmp_path / "digits"
    command = [sys.executable, "-m", "vitray.cli", "data", "prepare", "builtin:digits", str(dest)]
    proc = subprocess.Popen(
        [*command, "--samples-per-shard", "1", *(["--serial"] if serial else [])],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(dest.glob("*.tar"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the preparation ended before it could be interrupted"
        if signame == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if signame == "SIGINT":
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1] == (
            "stopped by user (Ctrl-C): vitray data prepare did not finish; the same command goes on preparing "
            f"{dest} from the shards written"
        )
    else:
        assert proc.returncode == 143, err
        assert (
            f"vitray: SIGTERM (pid {proc.pid}): stopped preparing {dest}; no shard is left half-written, and the same "
            "command goes on from the shards written"
        ) in err
        assert "SIGTERM received" not in err and "Aborted" not in err, err[-3000:]  # Ray's C++ handler
    assert "Traceback" not in err
    assert not (dest / "dataset.json").exists()
    assert_gone_with(proc.pid)
    if signame == "SIGTERM":  # the same command goes on from what the Ray tasks wrote before the stop
        from vitray.data import verify_dataset

        again = subprocess.run([*command, "--samples-per-shard", "1", "--serial"], capture_output=True, text=True)
        assert again.returncode == 0, again.stderr
        kept = re.search(r"going on with the preparation stopped earlier: (\d+) of 1,797 shards", again.stdout)
        assert kept and int(kept.group(1)) >= 3, again.stdout
        assert verify_dataset(str(dest)).whole


@pytest.mark.slow
def test_ray_prepare_goes_on_from_a_stopped_preparation(local_ray, digits_dataset, tmp_path, capsys):
    """The Ray path keeps the shards a stopped run wrote (the same files: not rewritten) and writes
    only the others, to the dataset one run writes."""
    from test_cli_prepare_refusals import stopped_after

    from vitray.data import prepare_dataset

    dest = tmp_path / "digits"
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset("builtin:digits", str(dest), samples_per_shard=100, map_fn=stopped_after(5))
    kept = {p.name: p.stat().st_ino for p in dest.glob("*.tar")}
    assert len(kept) == 5
    capsys.readouterr()
    prepare_dataset_on_ray("builtin:digits", str(dest), samples_per_shard=100)
    captured = capsys.readouterr()
    assert "5 of 19 shards (500 images) already written" in captured.out
    assert "preparing digits: 1,297/1,297 images (100%)" in captured.err  # what was left to write
    assert {name: (dest / name).stat().st_ino for name in kept} == kept
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == {
        p.name: p.read_bytes() for p in digits_dataset.iterdir()
    }


@pytest.mark.slow
def test_sigterm_while_ray_starts_is_the_stops_line_and_leaves_no_process(tmp_path):
    """SIGTERM while the embedded Ray starts (a scheduler's stop in the first seconds): Ray's own
    handler exited 15 mid-start, said nothing and left its agents running. Now the start finishes,
    and the command stops as it does in the task loop: exit 143 and its line, nothing left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    dest = tmp_path / "digits"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitray.cli", "data", "prepare", "builtin:digits", str(dest)],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in proc.stderr:  # up to Ray's start, the command's own lines
            lines.append(line)
            if line.startswith("starting a local Ray instance"):
                break
        time.sleep(1.0)  # inside ray.init (several seconds on this machine)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, "".join(lines) + err
    assert (
        f"vitray: SIGTERM (pid {proc.pid}): stopped preparing {dest}; no shard is left half-written, and the same "
        "command goes on from the shards written"
    ) in err
    assert "Traceback" not in err
    assert not list(dest.glob("*.tar"))
    assert_gone_with(proc.pid)

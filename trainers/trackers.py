"""Experiment trackers: rank 0 sends the run's config and every metric it writes to
`metrics.jsonl` to MLflow (`log.mlflow`) and/or Weights & Biases (`log.wandb`) as well. Both are
off by default and need the `trackers` extra (`pip install 'vitray[trackers]'`).

A resumed run goes on in the same tracker run, so its curves continue instead of starting a new
line: MLflow's run is found by its `vitray.run_dir` tag, W&B's id is derived from the run folder
(`resume="allow"`). Only numbers are sent (MLflow takes nothing else); the config goes as MLflow
params (flattened, credentials masked as in the checkpoint) and as W&B's nested config.
"""

from __future__ import annotations

import hashlib
import importlib.util
import netrc
import os
import re
import time
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from vitray.common.config import flatten_config
from vitray.data.config import StoragePath
from vitray.storage import absolute

__all__ = ["MlflowSettings", "Trackers", "WandbSettings", "missing_tracker_packages", "mlflow_store_problem"]

_PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch
_PARAM_VALUE_CHARS = 6000  # MLflow's limit for one param value
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # a URI's: a server, a database, a file:// URL


def tracking_uri_here(uri: str | None) -> str | None:
    """An MLflow tracking URI with a relative local store made absolute against this process's
    working directory (the driver's, where the config is read): rank 0 runs in a working directory
    of its own, where ``mlruns`` or ``sqlite:///mlflow.db`` would name another store. A folder
    (``mlruns``, ``file:mlruns``) and a SQLite file (``sqlite:///mlflow.db``) are made absolute;
    servers (``http://...``, ``databricks``) and absolute stores stay as given."""
    if uri is None or uri in ("databricks", "databricks-uc"):
        return uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + absolute(uri.removeprefix("sqlite:///"))
    if uri.startswith("file:") and not uri.startswith("file://"):
        return "file:" + absolute(uri.removeprefix("file:"))
    if _SCHEME.match(uri):
        return uri
    return absolute(uri)


# The store of `log.mlflow: {}` without MLFLOW_TRACKING_URI: a folder. MLflow 3's own default, a
# SQLite file, needs SQLAlchemy and Alembic, which `mlflow-skinny` (the `trackers` extra) lacks.
DEFAULT_MLFLOW_STORE = "mlruns"


class MlflowSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tracking_uri: Annotated[str | None, AfterValidator(tracking_uri_here)] = Field(
        None,
        description="MLflow tracking URI; MLFLOW_TRACKING_URI when unset, else the folder mlruns. A relative local "
        "store (mlruns, sqlite:///mlflow.db) is read against the working directory where the config is read; a "
        "folder store is used as MLflow 3 allows it (MLFLOW_ALLOW_FILE_STORE), a sqlite:/// one needs SQLAlchemy "
        "(the full mlflow package).",
    )
    experiment: str = Field("vitray", description="Experiment name (created when missing).")

    @model_validator(mode="after")
    def _store_where_the_config_is_read(self) -> MlflowSettings:
        """The store resolved where the config is read (the driver): rank 0 runs elsewhere."""
        if self.tracking_uri is None:
            self.tracking_uri = tracking_uri_here(os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_MLFLOW_STORE)
        return self


def _is_folder_store(uri: str) -> bool:
    return uri.startswith("file:") or not _SCHEME.match(uri)


def _mlflow_client(settings: MlflowSettings):
    """A client of the run's store; a folder store allowed as asked for (MLflow 3 refuses one unless
    MLFLOW_ALLOW_FILE_STORE is set: the store is in "maintenance mode", and works)."""
    from mlflow.tracking import MlflowClient

    uri = settings.tracking_uri or DEFAULT_MLFLOW_STORE
    if _is_folder_store(uri):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=uri)


def mlflow_store_problem(settings: MlflowSettings | None) -> str | None:
    """Why the run's MLflow store cannot be used from here (one line), or None: a store the tracker
    would fail to open in rank 0, after Ray and the workers started."""
    if settings is None:
        return None
    # One quick try: MLflow's own retries wait about 4 minutes on a server that does not answer.
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    quick = {name: value for name, value in quick.items() if name not in os.environ}  # the user's own win
    os.environ.update(quick)
    try:
        _mlflow_client(settings).search_experiments(max_results=1)
    except Exception as error:
        said = (str(error).strip().splitlines() or [type(error).__name__])[0].split(". ")[0]
        hint = ""
        if (settings.tracking_uri or "").startswith("sqlite:") or "sqlalchemy" in said.lower():
            hint = (
                " (a sqlite:/// store needs SQLAlchemy and Alembic: pip install mlflow, or use a folder such as mlruns)"
            )
        return f"log.mlflow.tracking_uri={settings.tracking_uri}: the MLflow store cannot be opened: {said}{hint}"
    finally:
        for name in quick:
            os.environ.pop(name, None)
    return None


class WandbSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    project: str = Field("vitray", description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); your default when unset.")
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: write the run locally (`wandb sync` later)."
    )
    dir: StoragePath | None = Field(None, description="Local folder for W&B's files; the working directory when unset.")


def missing_tracker_packages(mlflow: MlflowSettings | None, wandb: WandbSettings | None) -> list[str]:
    """The settings whose package is not installed, as "log.mlflow (mlflow)"."""
    wanted = {"log.mlflow (mlflow)": (mlflow, "mlflow"), "log.wandb (wandb)": (wandb, "wandb")}
    return [
        key
        for key, (settings, module) in wanted.items()
        if settings is not None and not importlib.util.find_spec(module)
    ]


def wandb_login_missing(wandb: WandbSettings | None) -> bool:
    """Whether an online W&B run would find no API key in this process's environment: the
    WANDB_API_KEY variable, an identity token file, or the netrc entry `wandb login` writes for the
    W&B host. Without one, `wandb.init` fails in the worker, after Ray and the workers started."""
    if wandb is None or wandb.mode != "online" or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return False
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return False
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is None
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one wandb could not read either
        return True


class Trackers:
    """The trackers a run's `log` section enables, started for the run folder `run_dir`."""

    def __init__(
        self,
        mlflow: MlflowSettings | None,
        wandb: WandbSettings | None,
        *,
        run_name: str,
        run_dir: str,
        config: dict[str, Any],
    ):
        self._mlflow = _Mlflow(mlflow, run_name, run_dir, config) if mlflow is not None else None
        self._wandb = _Wandb(wandb, run_name, run_dir, config) if wandb is not None else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not numbers:
            return
        for tracker in (self._mlflow, self._wandb):
            if tracker is not None:
                tracker.log(step, numbers)

    def close(self, *, failed: bool = False) -> None:
        for tracker in (self._mlflow, self._wandb):
            if tracker is not None:
                tracker.close(failed)


class _Mlflow:
    def __init__(self, settings: MlflowSettings, run_name: str, run_dir: str, config: dict[str, Any]):
        from mlflow.entities import Param

        self.client = _mlflow_client(settings)
        experiment = self.client.get_experiment_by_name(settings.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.experiment)
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`vitray.run_dir` = '{run_dir}'", max_results=1
        )
        if found:  # a resume: the same MLflow run goes on
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self.client.create_run(
            experiment_id, run_name=run_name, tags={"vitray.run_dir": run_dir}
        ).info.run_id
        params = [Param(k, str(v)[:_PARAM_VALUE_CHARS]) for k, v in sorted(flatten_config(config).items())]
        for start in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[start : start + _PARAMS_PER_CALL])

    def log(self, step: int, numbers: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numbers.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class _Wandb:
    def __init__(self, settings: WandbSettings, run_name: str, run_dir: str, config: dict[str, Any]):
        import wandb

        run_id = "vitray-" + hashlib.sha256(run_dir.encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=run_name,
            id=run_id,
            resume="allow",
            mode=settings.mode,
            dir=settings.dir,
            config=config,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, numbers: dict[str, float]) -> None:
        self.run.log(numbers, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)

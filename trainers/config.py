"""The training config tree (pre-training and fine-tuning): each component owns its section and
this module composes them.

Defaults follow the paper's pre-training settings (Table 3: Adam b1=0.9, b2=0.999, batch 4096,
10k warm-up steps then linear decay, weight decay 0.1 as its JFT-300M rows, grad-norm clip 1.0
as its ImageNet-1k runs); `configs/paper/` holds each recipe, `configs/demo.yaml` scales one down
to one CPU machine.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from vitray.data.config import DataConfig, StoragePath
from vitray.data.plan import default_num_slots
from vitray.evaluation.evaluators import EVAL_NAME, NAME_RULE, EvalConfig
from vitray.models.config import ModelConfig
from vitray.models.variants import Variant, get_variant
from vitray.runfolder.run_report import ENGINE_NAMESPACES
from vitray.storage import absolute
from vitray.storage.retries import OUTAGE_S
from vitray.trainers.driver_checks.tpu_slices import tpu_slice
from vitray.trainers.engines.registry import ENGINES
from vitray.trainers.engines.seam import Engine
from vitray.trainers.step.masked_patch import DOWNSIZED_GRID, MaskedPatchTarget, target_outputs
from vitray.trainers.trackers import MlflowSettings, WandbSettings

# Run and evaluator names become folder names and metric prefixes: the same safe alphabet.
_RUN_NAME = EVAL_NAME


def default_loader_workers(cpus_per_worker: float, micro_batch_size: int, *, accelerated: bool) -> int:
    """``data.num_workers`` when unset: on GPUs or TPUs as many of the CPUs Ray gives the training
    worker, less the one its own process runs on (its step is the accelerator's), as divide the
    micro batch, at least 1; on the CPU 1: there the step needs the cores far more than decoding
    does (a ViT step costs a CPU tens of times what decoding its images does).

    Dividing the micro batch gives every worker a slot of its own (the default ``num_slots`` is one
    per worker that divides it): 15 workers on a micro batch of 256 would share one slot per rank,
    each reading all of its bytes (15 times the reads, over S3 too) to decode every 15th batch;
    8 read 8 slots, once each."""
    if not accelerated:
        return 1
    budget = max(1, int(cpus_per_worker) - 1)
    return max(n for n in range(1, budget + 1) if micro_batch_size % n == 0)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("vitray-run", description="Run id; re-running with the same name and storage resumes.")
    storage: StoragePath = Field(
        "./runs",
        description="Where runs live: a local folder (./runs: under the working directory) or s3://bucket/prefix.",
    )
    lease_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A second driver of the same run refuses while the first's lease heartbeat is "
        "younger than this; an older lease is taken over (vitray.runfolder.lease).",
    )
    lease_without_conditional_writes: bool = Field(
        False,
        description="Use an S3 store that ignores conditional writes (If-None-Match / If-Match), which "
        "the lease probes for and otherwise refuses: two drivers of one run started within seconds of "
        "each other may then both write its checkpoints.",
    )
    preemption_grace_s: float = Field(
        30.0,
        gt=0,
        description="After SIGTERM to the driver: how long the workers have to write a checkpoint "
        "and stop before the driver exits without one.",
    )
    storage_outage_s: float = Field(
        OUTAGE_S,
        gt=0,
        description="How long the storage calls a run makes while it trains (the stop-file check, the lease "
        "heartbeat, the metrics and checkpoint uploads, opening data shards, the evaluators' reads) wait for a store that does not answer (connection "
        "refused, timeouts, 503 SlowDown), counted from the first failed try, before the run fails (or spends a "
        "worker-group restart, cluster.max_failures); the driver's console says once when an outage of its own "
        "calls starts and once when it ends (the workers' say so in their logs, and with --verbose). No "
        "worker-group restart is spent on an outage shorter than this.",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not _RUN_NAME.match(name):
            raise ValueError(NAME_RULE)
        return name


class InitConfig(_Section):
    """Where the weights start. Start-up order: resume the run -> these weights -> scratch."""

    checkpoint: StoragePath | None = Field(
        None, description="A vitray checkpoint folder, or a run folder (its latest complete checkpoint)."
    )
    reset_head: bool = Field(
        True,
        description="Replace the head with a zero-initialised one (fine-tuning); with train.objective=masked_patch, "
        "start a fresh predictor (false keeps the checkpoint's own, of the same size).",
    )


class MaskedPatchConfig(_Section):
    """Masked patch prediction (paper appendix B.1.2), used when train.objective=masked_patch."""

    corrupt_rate: float = Field(0.5, gt=0, le=1, description="Fraction of each image's patches corrupted (rounded).")
    mask_rate: float = Field(
        0.8, ge=0, le=1, description="Of the corrupted: replaced by the learnable [mask] embedding."
    )
    random_rate: float = Field(
        0.1, ge=0, le=1, description="Of the corrupted: replaced by another random patch's embedding."
    )
    keep_rate: float = Field(0.1, ge=0, le=1, description="Of the corrupted: kept as they are (still predicted).")
    target: MaskedPatchTarget = Field(
        "mean_color",
        description="mean_color: the patch's mean colour (one class of 2^(3 bits)); downsized_4x4: the patch "
        "downsized to 4x4 (16 such classes); patch_l2: L2 regression on the patch's pixels.",
    )
    color_bits: int = Field(
        3, ge=1, le=8, description="Bits per colour channel of the colour classes (3: 512 classes)."
    )

    @model_validator(mode="after")
    def _rates_sum_to_one(self) -> MaskedPatchConfig:
        total = self.mask_rate + self.random_rate + self.keep_rate
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"mask_rate + random_rate + keep_rate must be 1 (they split the corrupted patches), got "
                f"{self.mask_rate} + {self.random_rate} + {self.keep_rate} = {total:g}"
            )
        return self


class TrainConfig(_Section):
    """What is trained and how much: the backend, the objective, the batch and its accumulation."""

    backend: Literal[tuple(ENGINES)] = Field(  # type: ignore[valid-type]  # the registered engines
        next(iter(ENGINES)), description="; ".join(f"{e.name}: {e.description}" for e in ENGINES.values()) + "."
    )
    objective: Literal["auto", "softmax", "sigmoid", "masked_patch"] = Field(
        "auto",
        description="auto: softmax cross-entropy for single-label data, sigmoid for multi-label; masked_patch: "
        "self-supervised masked patch prediction (train.masked_patch), which needs no labels.",
    )
    masked_patch: MaskedPatchConfig = Field(default_factory=MaskedPatchConfig)
    steps: int = Field(10_000, gt=0, description="Optimizer steps of the whole run (the schedule decays to them).")
    batch_size: int = Field(4096, gt=0, description="Global batch (all workers, one optimizer step).")
    micro_batch_size: int = Field(32, gt=0, description="Samples per worker per forward/backward.")
    zero_stage: int = Field(
        1,
        ge=0,
        le=3,
        description="DeepSpeed ZeRO: 0 none, 1 optimizer state sharded over the workers, 2 also gradients, 3 also "
        "weights (gathered in the forward pass).",
    )
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Share of each target spread over all classes.")
    mixup_alpha: float = Field(0.0, ge=0, description="Mixup Beta(alpha, alpha); 0 disables it.")
    compile: bool | None = Field(
        None,
        description="torch.compile the model (in place: weights and checkpoints unchanged). null: on for CUDA, "
        "off elsewhere (on the CPU compiling costs more than a short run gains; XLA compiles its own graphs).",
    )
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = Field(
        "auto",
        description="The fused attention kernel of the training step (`trainers/step/attention.py`). auto: on CUDA flash "
        "attention first, then cuDNN, memory-efficient, math; elsewhere PyTorch's choice. A named kernel that cannot "
        "run the model's shapes and dtype on this device is refused at start. The kernel that runs is printed at start.",
    )
    nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A NaN/inf loss or gradient. stop: the run stops with an error at the next log or checkpoint "
        "step, before any checkpoint is written (the latest one stays finite; a model never trains on silently). "
        "skip: the optimizer step of such a step is dropped (its gradients discarded, no optimizer or lr-schedule "
        "step; DeepSpeed's overflow check, which reads the device every step) and counted in the metrics as "
        "`nonfinite_steps`; the run goes on. stop is the default: a NaN usually means a bug or an lr too high, "
        "which skipping would hide. skip needs train.backend=deepspeed.",
    )
    check_grad_overflow: bool = Field(
        False,
        description="bf16: DeepSpeed checks the gradients for inf/NaN before each optimizer step and skips the "
        "step; each check makes the host wait for the device. Off: bf16 has fp32's range, and train.nonfinite=stop "
        "stops the run at the next log or checkpoint step (train.nonfinite=skip turns the check on). (fp16 always "
        "checks; fp32 ZeRO always checks the grad norm.)",
    )


class OptimConfig(_Section):
    """The optimizer, with the authors' weight-decay rule (`trainers/step/optim.py`), and weight averaging."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="adamw: pre-training; sgd (momentum): fine-tuning.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (after warm-up).")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="Weight decay, on weight matrices only (not biases, norms, embeddings). adamw: decoupled, in "
        "torch's convention: each step decays by the scheduled lr x this (the paper's values; big_vision's `wd` is "
        "lr x this, e.g. 1e-4 at lr 1e-3 is 0.1 here). sgd: L2, added to the gradient (torch's SGD).",
    )
    b1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay.")
    b2: float = Field(0.999, ge=0, lt=1, description="AdamW's second-moment decay.")
    eps: float = Field(1e-8, gt=0, description="AdamW's denominator epsilon.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    grad_clip: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 disables it.")
    ema_decay: float | None = Field(None, gt=0, lt=1, description="Polyak/EMA weight averaging decay.")


class ScheduleConfig(_Section):
    """Learning rate: linear warm-up, then linear or cosine decay to `min_lr` at `train.steps`."""

    warmup_steps: int = Field(
        10_000, ge=0, description="Steps of linear warm-up from 0 to optim.lr (unset: capped at train.steps)."
    )
    decay: Literal["linear", "cosine"] = Field(
        "linear", description="Decay after the warm-up, to min_lr at train.steps."
    )
    min_lr: float = Field(
        0.0,
        ge=0,
        description="Learning rate the decay reaches at train.steps: the last step trains one decay step above it "
        "(as big_vision's schedule).",
    )


class PrecisionConfig(_Section):
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="Training precision (DeepSpeed mixed precision; XLA: bf16 autocast). fp8: the transformer "
        "blocks' linear layers compute in float8 (torchao), bf16 elsewhere; a GPU of compute capability 8.9+ "
        "(H100, H200, L4), emulated on the CPU.",
    )
    fp8_scaling: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise",
        description="With dtype=fp8: one float8 scale per tensor (fastest on H100/H200) or per row (more "
        "accurate with outliers, slower on Hopper).",
    )
    fp8_layers: Literal["auto", "all"] = Field(
        "auto",
        description="With dtype=fp8, which of the blocks' linear layers compute in float8: auto, those wide enough "
        "for float8 to be faster than bf16 on an H100 (all of H/14; qkv and fc1 of S/16 to L/16; none of Ti/16, "
        "which is refused); all, every one (numerics on small models).",
    )


class CheckpointConfig(_Section):
    every: int = Field(1000, gt=0, description="Checkpoint every N steps (and at the end).")
    keep: int = Field(3, gt=0, description="Complete checkpoints kept; older ones are deleted.")
    model_weights: Literal["every", "last", "none"] = Field(
        "last",
        description="Which checkpoints also hold the consolidated fp32 weights (model.safetensors, 4 bytes a "
        "parameter) that evaluation and export read: every one, the run's last one only, or none. Without "
        "them evaluation and export derive the weights from the optimizer's shards (slower: they read 3x the "
        "bytes); a resume never reads them. DeepSpeed only (every ZeRO stage): the XLA engine always writes them.",
    )
    staging_dir: StoragePath | None = Field(
        None,
        description="Local folder for the copies of a remote checkpoint that a resume reads; the system's "
        "temporary folder when unset. Checkpoints themselves are written straight into the run folder.",
    )
    preemption_check_every: int = Field(
        5, gt=0, description="Steps between checks for a pre-emption notice (one small broadcast each)."
    )


class LogConfig(_Section):
    every: int = Field(50, gt=0, description="Training metrics every N steps (and at the end).")
    peak_tflops: float | None = Field(
        None, gt=0, description="Accelerator peak TFLOP/s per worker for MFU; known GPUs are detected."
    )
    upload_every_s: float = Field(
        10.0,
        ge=0,
        description="Least seconds between two background uploads of the metrics to the run folder "
        "(steps never wait for them; checkpoints and the end of the run upload at once).",
    )
    mlflow: MlflowSettings | None = Field(
        None, description="Also log the config and metrics to MLflow (rank 0), e.g. {tracking_uri: http://HOST:5000}."
    )
    wandb: WandbSettings | None = Field(
        None, description="Also log the config and metrics to Weights & Biases (rank 0), e.g. {project: vit}."
    )


class ClusterConfig(_Section):
    """The worker group. Plain data: cluster/ turns it into Ray's ScalingConfig."""

    address: str | None = Field(None, description="Ray address; none starts an embedded local Ray.")
    num_workers: int = Field(2, gt=0, description="Training workers (Ray Train), one per GPU on GPU nodes.")
    cpus_per_worker: float | None = Field(
        None,
        gt=0,
        description="CPUs Ray reserves for each training worker (its data loader's workers run on them). "
        "Unset: 1 on a CPU run; on GPUs, once Ray is up, a GPU node's CPUs but one per GPU (times "
        "gpus_per_worker); on TPUs a TPU host's CPUs but one (see `with_worker_cpus`).",
    )
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each worker reserves; 0 trains on CPUs.")
    resources_per_worker: dict[str, Annotated[float, Field(ge=0)]] = Field(
        default_factory=dict, description="Other Ray resources each worker reserves, e.g. {my_node_type: 1}."
    )
    max_failures: int = Field(0, ge=-1, description="Worker-group restarts from the latest checkpoint; -1 = unlimited.")
    shared_filesystem: bool = Field(
        False,
        description="Local paths (run.storage, data.train, data.val, init.checkpoint) are on a filesystem that every "
        "node mounts at the same path (NFS, Lustre, ...). Without it a run on a cluster of several nodes refuses "
        "local paths: each node would write its own checkpoints, and a resume would find them scattered.",
    )
    tpu: str | None = Field(
        None, description='A TPU slice, e.g. "v4-32", "v5e-16", "v6e-16" (train.backend=xla): one worker per TPU host.'
    )
    tpu_topology: str | None = Field(None, description='The slice\'s topology, e.g. "2x2x4"; default: its usual one.')

    @property
    def accelerated(self) -> bool:
        return self.gpus_per_worker > 0 or self.tpu is not None

    @model_validator(mode="after")
    def _cpu_run_cpus(self) -> ClusterConfig:
        if self.cpus_per_worker is None and not self.accelerated:
            self.cpus_per_worker = 1.0  # a CPU run's worker: its step takes whatever cores it finds
        return self

    @model_validator(mode="after")
    def _tpu_slice(self) -> ClusterConfig:
        if "TPU" in self.resources_per_worker:  # Ray Train refuses it once Ray is up: said here
            raise ValueError(
                "cluster.resources_per_worker: TPU chips are reserved by cluster.tpu (the slice, e.g. v6e-16: one "
                "worker per TPU host with its chips), not as a resource; set cluster.tpu and drop TPU here"
            )
        if self.tpu is None:
            if self.tpu_topology is not None:
                raise ValueError("cluster.tpu_topology needs cluster.tpu (the slice, e.g. v4-32)")
            return self
        tpu = tpu_slice(self.tpu, self.tpu_topology)  # gpus_per_worker is not used on a TPU slice
        if "num_workers" not in self.model_fields_set:
            self.num_workers = tpu.hosts
        elif self.num_workers != tpu.hosts:
            raise ValueError(
                f"cluster.num_workers={self.num_workers}, but the TPU slice {tpu.name} has {tpu.hosts} host(s) and "
                "runs one worker per host: leave num_workers out or set it to that"
            )
        return self


class DebugConfig(_Section):
    record_sample_keys: StoragePath | None = Field(
        None, description="A folder: each rank appends the sample keys it trains on, with the step."
    )
    kill_worker_at_step: int | None = Field(
        None, gt=0, description="Fault-injection for tests: the last rank SIGKILLs itself once at this step."
    )
    nonfinite_loss_at_steps: list[int] = Field(
        default_factory=list,
        description="Fault-injection for tests: the last rank's loss is multiplied by NaN at these steps (a real "
        "NaN through the backward pass and the optimizer).",
    )
    step_delay_s: float = Field(
        0.0,
        ge=0,
        le=60,
        description="Tests: every step waits this long before its work, so that a test can act on a run in "
        "progress (a small model's run otherwise ends in seconds). Changes no result.",
    )
    checkpoint_record_delay_s: float = Field(
        0.0,
        ge=0,
        le=600,
        description="Tests: each rank waits this long between writing its checkpoint files and its completion "
        "record, so that a test can kill a run in the middle of a checkpoint. Changes no result.",
    )
    loader_only: bool = Field(
        False,
        description="Benchmarks: every step reads its batches through the device feed and trains on none (no "
        "forward, backward or optimizer step), so that images_per_s is what the loader delivers inside a run "
        "(benchmarks/loader_in_run.py).",
    )


_EVALS_EXAMPLE = "e.g. evals: {val: {type: val, every: 100, batch_size: 256}}"

# Keys of the one flat `train:` section of old, and where they live now. The config loader
# (`load_config` / `validate_config`) refuses them with this hint instead of "unknown key".
MOVED_KEYS: dict[str, str] = {
    "train.optimizer": "moved to optim.name",
    "train.lr": "moved to optim.lr",
    "train.weight_decay": "moved to optim.weight_decay",
    "train.b1": "moved to optim.b1",
    "train.b2": "moved to optim.b2",
    "train.eps": "moved to optim.eps",
    "train.momentum": "moved to optim.momentum",
    "train.grad_clip": "moved to optim.grad_clip",
    "train.ema_decay": "moved to optim.ema_decay",
    "train.warmup_steps": "moved to schedule.warmup_steps",
    "train.decay": "moved to schedule.decay",
    "train.min_lr": "moved to schedule.min_lr",
    "train.precision": "moved to precision.dtype",
    "train.checkpoint_every": "moved to checkpoint.every",
    "train.keep_checkpoints": "moved to checkpoint.keep",
    "train.log_every": "moved to log.every",
    "train.peak_tflops": "moved to log.peak_tflops",
    "train.eval_every": f"moved to evals.<name>.every ({_EVALS_EXAMPLE})",
    "train.eval_batch_size": f"moved to evals.<name>.batch_size ({_EVALS_EXAMPLE})",
    "train.fewshot_datasets": "moved to an evaluator of type fewshot (e.g. evals: {fewshot: {type: fewshot, "
    "every: 1000, datasets: {digits: PATH}, shots: [10], seeds: 1}})",
}


def _check_predictor_size(outputs: int, variant: Variant, masked: MaskedPatchConfig) -> None:
    """A masked patch predictor larger than the variant's encoder is a mistyped colour depth (8 bits:
    16.7M colour classes, 3.2e9 parameters on Ti), which would only run out of memory on the workers."""
    size = variant.size
    predictor = outputs * (size.width + 1)
    encoder = size.depth * (4 * size.width**2 + 2 * size.width * size.mlp_dim)
    if predictor > encoder:
        raise ValueError(
            f"train.masked_patch.color_bits={masked.color_bits} gives {masked.target} {outputs:,} outputs per patch: "
            f"a predictor of {predictor / 1e6:,.1f}M parameters, larger than a {variant.name} encoder "
            f"({encoder / 1e6:,.1f}M); lower color_bits (the paper's is 3)"
        )


class TrainingConfig(_Section):
    """One training run -- pre-training from scratch or fine-tuning from `init.checkpoint`."""

    MOVED_KEYS: ClassVar[dict[str, str]] = MOVED_KEYS

    seed: int = Field(
        0,
        ge=0,
        le=2**63 - 1,  # torch.manual_seed's largest
        description="Seeds the model's initialisation, the sample order and every step's randomness.",
    )
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    evals: dict[str, EvalConfig] = Field(
        default_factory=dict,
        description="name -> evaluator run during training; its metrics are named <name>/<metric> "
        f"({_EVALS_EXAMPLE}; see vitray.evaluation.evaluators).",
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    debug: DebugConfig = Field(default_factory=DebugConfig)

    @field_validator("evals")
    @classmethod
    def _eval_names(cls, evals: dict[str, Any]) -> dict[str, Any]:
        for name in evals:
            if not EVAL_NAME.match(name):
                raise ValueError(f"evaluator name {name!r} {NAME_RULE} (it prefixes the evaluator's metric names)")
            if f"{name}/".startswith(ENGINE_NAMESPACES):
                raise ValueError(f"evaluator name {name!r} is taken by the engine's own metrics: give it another name")
        return evals

    @property
    def engine(self) -> Engine:
        """The engine `train.backend` names (`vitray.trainers.engines`)."""
        return ENGINES[self.train.backend]

    @model_validator(mode="after")
    def _engine_rules(self) -> TrainingConfig:
        cluster = self.cluster
        if self.engine.tpu and cluster.tpu is None and "num_workers" not in cluster.model_fields_set:
            # Several workers of a TPU engine are a slice's hosts (cluster.tpu); without a slice, one
            self.cluster = cluster.model_copy(update={"num_workers": 1})
        self.engine.check_config(self)
        return self

    @model_validator(mode="after")
    def _val_needs_classifier(self) -> TrainingConfig:
        if self.train.objective == "masked_patch":
            for name, ev in self.evals.items():
                if ev.type == "val":
                    raise ValueError(
                        f"evals.{name} (type val) scores a classifier, but train.objective=masked_patch trains none: "
                        f"remove it (--set evals.{name}=null; a type fewshot evaluator probes the features)"
                    )
        return self

    @model_validator(mode="after")
    def _gpu_decode_needs_cuda(self) -> TrainingConfig:
        engine = self.engine
        if self.data.decode == "gpu" and (not engine.gpu_decode or not self.cluster.gpus_per_worker):
            where = (
                f"{engine.hardware} (train.backend={engine.name})"
                if not engine.gpu_decode
                else "CPUs (cluster.gpus_per_worker=0)"
            )
            raise ValueError(
                f"data.decode=gpu decodes JPEGs with nvjpeg on the workers' GPUs, but this run trains on {where}: "
                "use data.decode=auto (gpu on CUDA, cpu otherwise) or data.decode=cpu"
            )
        return self

    @model_validator(mode="after")
    def _tpu_needs_xla(self) -> TrainingConfig:
        if self.cluster.tpu is not None and not self.engine.tpu:
            able = "|".join(name for name, engine in ENGINES.items() if engine.tpu)
            raise ValueError(
                f"cluster.tpu={self.cluster.tpu} needs train.backend={able} (got {self.train.backend}): "
                f"{self.train.backend} does not train on TPUs"
            )
        return self

    @model_validator(mode="after")
    def _storage_here(self) -> TrainingConfig:
        """run.storage's default (./runs) names a folder under this process's working directory: made
        absolute here and recorded as set, so that the workers, which run in working directories of
        their own and are sent what was set (:meth:`settings`), write the same run folder."""
        if "storage" not in self.run.model_fields_set:
            self.run = self.run.model_copy(update={"storage": absolute(self.run.storage)})
        return self

    @model_validator(mode="after")
    def _loader_workers(self) -> TrainingConfig:
        """An unset ``data.num_workers`` resolved here, so that the run's config (and its checkpoints)
        record the number it read with, and the default ``num_slots`` below derives from it."""
        cluster = self.cluster
        if self.data.num_workers is None and cluster.cpus_per_worker is not None:  # else: `with_worker_cpus`
            workers = default_loader_workers(
                cluster.cpus_per_worker, self.train.micro_batch_size, accelerated=cluster.accelerated
            )
            self.data = self.data.model_copy(update={"num_workers": workers})
        return self

    def settings(self) -> dict[str, Any]:
        """What was set, by the user or by a validator, as JSON: the dict that validates back to this
        config in another process (the workers) or with a change. A full dump would make every
        default a setting, and the rules that judge only what was asked for would then judge the
        defaults too: the paper's 10k-step warm-up, clamped to a shorter run when left unset, would
        be refused as longer than the run on the workers of every run under 10k steps."""
        return self.model_dump(mode="json", exclude_unset=True)

    def with_worker_cpus(self, nodes: list[dict[str, float]]) -> TrainingConfig:
        """This config with an unset ``cluster.cpus_per_worker`` (and an unset ``data.num_workers``
        derived from it) resolved from the resources of the Ray cluster's ``nodes`` (Ray's per-node
        resource dicts): on GPUs the CPUs of a GPU node per GPU, one CPU of each node left to Ray's
        own processes and tasks, times ``gpus_per_worker``; on TPUs a TPU host's CPUs but one; the
        smallest such node counts, and 1 where Ray has no such node yet (an autoscaler adds it later).
        A GPU node's cores are its GPUs' to share: with Ray's default of 1 CPU per worker a 16-core
        one-GPU node read the data with one loader worker (data_wait_fraction 0.7, an H100)."""
        cluster = self.cluster
        if cluster.cpus_per_worker is not None:
            return self
        if cluster.tpu is not None:
            shares = [node["CPU"] - 1 for node in nodes if node.get("TPU") and node.get("CPU")]
        else:
            shares = [
                (node["CPU"] - 1) / node["GPU"] * cluster.gpus_per_worker
                for node in nodes
                if node.get("GPU") and node.get("CPU")
            ]
        cpus = max(1, math.floor(min(shares))) if shares else 1
        settings = self.settings()
        settings.setdefault("cluster", {})["cpus_per_worker"] = float(cpus)
        return type(self).model_validate(settings)

    def new_run_num_slots(self) -> int:
        """The data slots a run starting from scratch uses: ``data.num_slots``, or when unset one
        per loader worker of every rank (as many of a rank's workers as divide its micro-batch:
        every slot gives each batch the same number of samples)."""
        if self.data.num_slots is not None:
            return self.data.num_slots
        if self.data.num_workers is None:
            raise ValueError("data.num_workers is resolved once Ray is up (TrainingConfig.with_worker_cpus)")
        return default_num_slots(self.cluster.num_workers, self.train.micro_batch_size, self.data.num_workers)

    @model_validator(mode="after")
    def _batch_divides(self) -> TrainingConfig:
        per_step = self.train.micro_batch_size * self.cluster.num_workers
        if self.train.batch_size % per_step:
            raise ValueError(
                f"train.batch_size={self.train.batch_size} must be a multiple of train.micro_batch_size x "
                f"cluster.num_workers = {self.train.micro_batch_size} x {self.cluster.num_workers} = {per_step} "
                "(gradient accumulation is derived from them)"
            )
        if self.data.num_slots is None and self.data.num_workers is None:
            return self  # the slots are known once Ray is up (`with_worker_cpus`), and checked then
        num_slots = self.new_run_num_slots()
        if num_slots % self.cluster.num_workers:
            raise ValueError(
                f"data.num_slots={num_slots} must be a multiple of cluster.num_workers="
                f"{self.cluster.num_workers} (each worker owns whole data slots)"
            )
        slots_per_worker = num_slots // self.cluster.num_workers
        if self.train.micro_batch_size % slots_per_worker:
            raise ValueError(
                f"train.micro_batch_size={self.train.micro_batch_size} must be a multiple of the data slots per "
                f"worker (data.num_slots / cluster.num_workers = {slots_per_worker}): every slot advances in lock-step"
            )
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> TrainingConfig:
        # Only a warm-up that was asked for: the default (the paper's 10k steps) is clamped to the
        # run by the schedule, so a short run that never named it still trains.
        warmup, steps = self.schedule.warmup_steps, self.train.steps
        if "warmup_steps" in self.schedule.model_fields_set and warmup > steps:
            raise ValueError(
                f"schedule.warmup_steps={warmup} is longer than the run (train.steps={steps}): the learning rate "
                f"would never reach its peak; set schedule.warmup_steps to at most {steps}"
            )
        return self

    @model_validator(mode="after")
    def _decay_goes_down(self) -> TrainingConfig:
        lr, min_lr = self.optim.lr, self.schedule.min_lr
        if min_lr > lr:
            raise ValueError(
                f"schedule.min_lr={min_lr:g} is above optim.lr={lr:g}: the decay after the warm-up would raise the "
                "learning rate to it; set schedule.min_lr at most optim.lr (0, the default, decays to zero)"
            )
        return self

    @model_validator(mode="after")
    def _nonfinite_policy(self) -> TrainingConfig:
        if self.train.nonfinite == "skip" and not self.engine.skips_nonfinite:
            able = "|".join(name for name, engine in ENGINES.items() if engine.skips_nonfinite)
            raise ValueError(
                f"train.nonfinite=skip needs train.backend={able} (an engine that drops a step whose gradients are not "
                f"finite); with train.backend={self.train.backend} use train.nonfinite=stop"
            )
        if self.train.nonfinite == "skip" and self.train.zero_stage == 0 and self.precision.dtype == "fp32":
            raise ValueError(
                "train.nonfinite=skip with train.zero_stage=0 and precision.dtype=fp32: DeepSpeed steps its plain "
                "optimizer there, which checks nothing before a step (a NaN step would be applied); use "
                "train.zero_stage=1 (the default), or bf16"
            )
        if self.train.check_grad_overflow and not self.engine.skips_nonfinite:
            raise ValueError(
                f"train.check_grad_overflow is DeepSpeed's check before each step; train.backend={self.train.backend} "
                "does not skip steps: leave it unset (train.nonfinite=stop stops a run whose loss is not finite)"
            )
        return self

    @model_validator(mode="after")
    def _masked_patch_model(self) -> TrainingConfig:
        """The model gets masked patch prediction's parts exactly when the objective needs them,
        so a checkpoint's model section (its architecture) always says whether it has them."""
        outputs = None
        if self.train.objective == "masked_patch":
            for knob in ("label_smoothing", "mixup_alpha"):
                if getattr(self.train, knob):
                    raise ValueError(f"train.{knob} acts on labels; train.objective=masked_patch has none: set it to 0")
            variant = get_variant(self.model.name)
            if variant.is_hybrid:
                raise ValueError(
                    f"train.objective=masked_patch needs a plain ViT; model.name={self.model.name} is a hybrid whose "
                    "ResNet sees the pixels of the corrupted patches"
                )
            if self.model.representation_size is not None:
                raise ValueError(
                    f"model.representation_size={self.model.representation_size} adds a pre-logits layer that "
                    "train.objective=masked_patch never trains (the features would pass through it at random): leave it out"
                )
            masked = self.train.masked_patch
            if masked.target == "downsized_4x4" and variant.patch_size % DOWNSIZED_GRID:
                raise ValueError(
                    f"train.masked_patch.target=downsized_4x4 cuts each patch into 4x4 cells; {variant.name}'s "
                    f"{variant.patch_size}-pixel patches do not split so: use a model with patches of a multiple of 4 "
                    "pixels, or another target"
                )
            outputs = target_outputs(masked.target, masked.color_bits, variant.patch_size)
            _check_predictor_size(outputs, variant, masked)
        elif changed := [  # (a run that trained otherwise, saying nothing; a full dump holds the defaults)
            key
            for key, default in MaskedPatchConfig().model_dump().items()
            if getattr(self.train.masked_patch, key) != default
        ]:
            keys = ", ".join(f"train.masked_patch.{key}" for key in changed)
            raise ValueError(
                f"{keys} set, but train.objective={self.train.objective}: they act only with "
                "train.objective=masked_patch; set it, or leave them out"
            )
        if self.model.masked_patch_outputs != outputs:
            self.model = self.model.model_copy(update={"masked_patch_outputs": outputs})
        return self

    @property
    def grad_accumulation(self) -> int:
        return self.train.batch_size // (self.train.micro_batch_size * self.cluster.num_workers)

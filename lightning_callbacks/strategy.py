"""``FGDiLoCoStrategy``: Factored Gossip DiLoCo as a Lightning strategy (``Trainer(strategy="fgdiloco")``).

One process per replica, as with DDP, but no ``DistributedDataParallel``: the replicas train on their own data
shards without a per-step gradient all-reduce, and every ``sync_every`` optimizer steps the outer round of
:class:`fgdiloco.FGDiLoCo` (gossip Mix1 / Mix2 and the local Nesterov outer step) brings them back together.

Pipeline stages (``pipeline_stages=S > 1``)
------------------------------------------
The processes form a :class:`fgdiloco.ReplicaMesh` of ``R = world // S`` replicas x ``S`` stages (global rank =
``replica * S + stage``); each rank holds one stage, the stages of a replica pass activations through a
:class:`fgdiloco.pipeline.Pipeline` (``n_microbatches`` per batch, ``pipeline_schedule`` "1f1b" or "gpipe"), and
each stage gossips with the same stage of the other replicas (``FGDiLoCo(stage, inner, mesh=mesh)``). The
LightningModule's contract:

* ``configure_pipeline_stage(self, stage: int, stages: int) -> nn.Module`` builds this rank's stage (called once,
  after ``setup`` / ``configure_model`` and before checkpoint restore and ``configure_optimizers``; the data module
  is set up by then). The strategy keeps it as ``module.pipeline_module``; the module must hold no other parameters
  (``ValueError``), so ``self.parameters()`` in ``configure_optimizers`` are the stage's. Stage 0 takes the batch's
  inputs, the last stage's output goes to ``pipeline_loss``.
* ``pipeline_loss(self, output, target) -> Tensor``: the mean loss over a microbatch, on the last stage.
* optional, ``configure_activation_codec(self, stage: int, stages: int)``: what crosses this rank's stage
  boundaries, as :class:`fgdiloco.pipeline.Pipeline`'s ``activation_codec`` (None: the activations as they are;
  e.g. ``activation_codec_for(self.pipeline_module)`` of :mod:`fgdiloco.pretrain.model` for a subspace GPT, which
  sends k coefficients per token each way). Called once per stage, after ``configure_pipeline_stage`` (so
  ``self.pipeline_module`` is this rank's stage, on its device). The strategy's ``activation_codec=`` argument
  does the same for modules without the hook; giving both is a ``ValueError``. A codec that ``needs_inputs``
  (the subspace codec) reads the batch's inputs on every stage: ``pipeline_step(inputs, target)`` already passes
  them everywhere.
* ``training_step`` calls ``loss = self.trainer.strategy.pipeline_step(inputs, target)`` on every rank with the
  replica's batch (the ``DistributedSampler`` is indexed by replica: ``num_replicas=R, rank=replica``, so all stages
  of a replica see the same batches), logs it and returns it. The forward and backward run there; the gradients
  are kept aside past Lightning's ``zero_grad`` and added in the strategy's ``backward`` (which runs no autograd but
  the precision plugin's and ``on_before_backward`` / ``on_after_backward`` hooks), so automatic optimisation,
  gradient accumulation, LR schedulers and callbacks work unchanged. The loss is broadcast from the last stage to
  the replica's other stages (one scalar per step on the pipeline group), so ``self.log`` shows the replica's loss
  on every rank (and the loggers, on rank 0, replica 0's). Manual optimisation: ``pipeline_step`` then
  ``opt.step()`` (``manual_backward`` is optional and does nothing more).
* ``validation_step`` / ``test_step`` use ``self.trainer.strategy.pipeline_eval(inputs, target)`` (forward only).
  Batches of one kind must keep one shape whose dim 0 divides into ``n_microbatches`` (use ``drop_last=True``).

Not supported with ``S > 1``: ``precision="16-mixed"`` (its GradScaler, ``ValueError``); gradient clipping acts on
each stage's own gradients (a per-stage norm, not the whole model's).

Checkpoints
-----------
Replicas differ between (and, with gossip, after) outer rounds, so one file cannot hold the job. For a checkpoint
written to ``PATH`` (``trainer.save_checkpoint(PATH)`` or ``ModelCheckpoint``; every rank takes part):

* ``PATH`` (written by global rank 0, the usual Lightning checkpoint) holds rank 0's replica: ``state_dict``
  (weights), ``optimizer_states`` (the inner optimizer), ``lr_schedulers``, loops, callbacks, hyper-parameters, plus
  ``checkpoint["fgdiloco"] = {"format": 1, "world_size": M, "replicas": "<name>.replicas", "state": ...}``
  where ``state`` is rank 0's :meth:`FGDiLoCo.state_dict` (outer momentum, round-start snapshot, round and step
  counters, seed, topology, codec state incl. error feedback) without the inner optimizer state, which is
  ``optimizer_states[0]``.
* ``PATH.replicas/rank{r}.pt`` (written by rank ``r``, for every ``r >= 1``) holds that replica's own
  ``state_dict``, ``optimizer_states``, precision-plugin state and ``fgdiloco`` state, plus ``rank`` and
  ``world_size``.

With ``pipeline_stages=S > 1`` the same files hold one part per (replica, stage): rank ``r`` = ``replica * S +
stage`` writes its stage's weights, inner optimizer and FGDiLoCo state (``PATH`` for rank 0, i.e. stage 0 of
replica 0), and the metadata and parts also record ``stages``, ``replica`` and ``stage``.

``trainer.fit(model, ckpt_path=PATH)`` on the same number of processes restores on every rank its own replica (rank
0 from ``PATH``, rank ``r`` from its part) and continues the same trajectory: the initial broadcast of rank 0's
weights is skipped. A different number of processes, or of ``pipeline_stages``, is refused with a ``ValueError``.
With ``S > 1`` ``trainer.validate/test(ckpt_path=PATH)`` also read each rank's own part (rank 0's weights are not
copied to the other ranks: they hold other stages).
``LightningModule.load_from_checkpoint(PATH)`` gives rank 0's replica. Global rank 0 alone removes checkpoints:
``PATH`` with its whole ``PATH.replicas`` folder, so ``ModelCheckpoint(save_top_k=k)`` keeps rank 0's top k, each
complete, also for a metric that differs between ranks (this assumes a checkpoint folder that every rank sees,
as resuming does). With ``save_last="link"`` the ``last`` link points at ``PATH`` only, so resume from the
linked file's own path.

``trainer.validate/test/predict`` (outside ``fit``) use DDP's set-up, which copies rank 0's weights to every
replica before evaluating; with ``ckpt_path`` they therefore evaluate rank 0's replica on every rank (the parts are
not read). This also overwrites the in-memory replicas of a model that was just fitted. Validation *during* ``fit``
evaluates each replica's own weights; a metric logged without ``sync_dist`` is rank 0's.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from fgdiloco.config import FGDiLoCoConfig
from fgdiloco.mesh import ReplicaMesh
from fgdiloco.outer import FGDiLoCo
from fgdiloco.pipeline import SCHEDULES, Pipeline
from fgdiloco.pipeline.codec import resolve_activation_codec, shape_inference

__all__ = ["FGDiLoCoStrategy", "LightningFGDiLoCoStrategy", "replica_checkpoint_path", "CHECKPOINT_KEY",
           "CHECKPOINT_FORMAT", "PIPELINE_MODULE_ATTRIBUTE"]

log = logging.getLogger("fgdiloco")

CHECKPOINT_KEY = "fgdiloco"
CHECKPOINT_FORMAT = 1

# Lightning >= 2.5.2 broadcasts a SIGTERM flag on the world group before every training batch
# (``_TrainingEpochLoop._broadcast_sigterm_tensor``), which puts all replicas in lockstep (docs/lightning.md).
_SIGTERM_BROADCAST_SINCE = Version("2.5.2")

_START_METHODS = ("popen", "spawn", "fork", "forkserver")

# Where the strategy puts the stage built by ``LightningModule.configure_pipeline_stage`` (a registered submodule).
PIPELINE_MODULE_ATTRIBUTE = "pipeline_module"


def replica_checkpoint_path(filepath: str | os.PathLike, rank: int) -> str:
    """Where rank ``rank``'s (>= 1) part of the checkpoint ``filepath`` lives: ``<filepath>.replicas/rank{r}.pt``."""
    return f"{os.fspath(filepath)}.replicas/rank{rank}.pt"


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _is_codec_factory(value: Any) -> bool:
    """A plain callable (``stage_module -> codec``) rather than a codec (an ``(encode, decode)`` pair or an object
    with ``encode`` / ``decode``, which may be callable itself, e.g. an ``nn.Module``)."""
    return callable(value) and not isinstance(value, tuple) and not (
        callable(getattr(value, "encode", None)) and callable(getattr(value, "decode", None)))


def _check_activation_codec(value: Any) -> None:
    """``activation_codec=``: None, an activation codec, or a factory ``stage_module -> codec`` (checked when the
    stage exists)."""
    if value is None or _is_codec_factory(value):
        return
    try:
        resolve_activation_codec(value)
    except TypeError as err:
        raise TypeError(f"activation_codec must be None, an activation codec or a callable stage_module -> codec: "
                        f"{err}") from None


def _local_sigterm_check(trainer: Any, exception: type[BaseException] | None) -> None:
    """Stand-in for the per-batch SIGTERM broadcast: act on this process's own signal, talk to no one."""
    if exception is not None and getattr(trainer, "received_sigterm", False):
        raise exception()


def _local_sigterm_notifier(connector: Any, signum: Any, frame: Any) -> None:
    """Lightning's SIGTERM notifier (``_SignalConnector._sigterm_notifier_fn``, >= 2.5.2) without its broadcast on
    the world group: the replicas are not in lockstep, and a dead rank never answers, so that broadcast blocks the
    signalled process (until torchrun's SIGKILL 30 s later, or the process-group timeout). It still forwards the
    signal to the popen launcher's children and sets ``trainer.received_sigterm``."""
    log.info("fgdiloco: rank %s received signal %s", getattr(connector.trainer, "global_rank", "?"), signum)
    if not connector.received_sigterm:
        launcher = connector.trainer.strategy.launcher
        if launcher is not None:
            launcher.kill(signum)
    connector.received_sigterm = True


def _known_backends() -> list[str]:
    """The process-group backends torch.distributed knows now (its own and those registered with
    ``torch.distributed.Backend.register_backend``)."""
    backend = getattr(dist, "Backend", None)
    return [b for b in getattr(backend, "backend_list", ["gloo", "nccl", "mpi"]) if b != "undefined"]


def _check_process_group_arguments(backend: Any, timeout: Any) -> None:
    """``process_group_backend`` / ``process_group_timeout``, checked when the strategy is built: torch checks them
    only in ``init_process_group`` at ``fit``, in every process."""
    if backend is not None:
        known = _known_backends()
        allowed = (f"None (Lightning's choice: 'nccl' on CUDA, 'gloo' otherwise), one of {known}, or per-device "
                   f"pairs such as 'cpu:gloo,cuda:nccl' (another backend once registered with "
                   f"torch.distributed.Backend.register_backend)")
        if not isinstance(backend, str):
            raise TypeError(f"process_group_backend must be {allowed}; got {type(backend).__name__}")
        names = [item.split(":", 1)[-1].strip().lower() for item in backend.split(",")]
        if not all(name in known for name in names):
            raise ValueError(f"process_group_backend must be {allowed}; got {backend!r}")
    if timeout is not None:
        if not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"process_group_timeout must be a datetime.timedelta (DDP's process-group timeout, e.g. "
                            f"datetime.timedelta(minutes=30)) or None (torch's default); got "
                            f"{type(timeout).__name__} {timeout!r}")
        if timeout <= datetime.timedelta(0):
            raise ValueError(f"process_group_timeout must be a positive datetime.timedelta, got {timeout!r}")


def _check_pipeline_arguments(stages: Any, microbatches: Any, schedule: Any) -> tuple[int, int, str]:
    """``pipeline_stages`` / ``n_microbatches`` / ``pipeline_schedule`` checked and normalised (no communication)."""
    for name, value in (("pipeline_stages", stages), ("n_microbatches", microbatches)):
        if value is None and name == "n_microbatches":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value}")
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise ValueError(f"pipeline_schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    schedule = schedule.lower()
    microbatches = stages if microbatches is None else microbatches
    if stages > 1 and schedule == "1f1b" and microbatches < stages:
        raise ValueError(f"n_microbatches must be >= pipeline_stages ({stages}) for pipeline_schedule='1f1b', got "
                         f"{microbatches}; use more microbatches or pipeline_schedule='gpipe'")
    return stages, microbatches, schedule


class _FGDiLoCoStrategyMixin:
    """The namespace-independent part of the strategy; :class:`FGDiLoCoStrategy` (``pytorch_lightning``) and
    :class:`LightningFGDiLoCoStrategy` (``lightning.pytorch``) add the namespace's ``DDPStrategy``."""

    strategy_name = "fgdiloco"
    _namespace: Any = None  # the Lightning package module (pytorch_lightning or lightning.pytorch)

    def __init__(
        self,
        config: FGDiLoCoConfig | None = None,
        *,
        broadcast_init: bool = True,
        pipeline_stages: int = 1,
        n_microbatches: int | None = None,
        pipeline_schedule: str = "1f1b",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        process_group_timeout: datetime.timedelta | None = dist.default_pg_timeout,
        start_method: str = "popen",
        activation_codec: Any = None,
        **settings: Any,
    ) -> None:
        if isinstance(settings.get("timeout"), datetime.timedelta):
            raise TypeError("timeout is FGDiLoCo's gossip deadline shorthand in seconds (a number); pass the "
                            "process-group timeout of DDP as process_group_timeout=datetime.timedelta(...)")
        _check_process_group_arguments(process_group_backend, process_group_timeout)
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        if not isinstance(broadcast_init, bool):
            raise TypeError(f"broadcast_init must be a bool, got {type(broadcast_init).__name__}")
        _check_activation_codec(activation_codec)
        stages, microbatches, schedule = _check_pipeline_arguments(pipeline_stages, n_microbatches,
                                                                   pipeline_schedule)
        # fail when the strategy is built, with the settings' own messages
        self._config = FGDiLoCoConfig.build(config, **settings)
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=process_group_timeout,
            start_method=start_method,
        )
        self._broadcast_init = broadcast_init
        self._fgdiloco: FGDiLoCo | None = None
        self._saved_as: dict[str, str] = {}  # save_checkpoint: a rank's own checkpoint path -> rank 0's
        self._resume_state: dict[str, Any] | None = None
        self._patched_loop: Any = None
        self._patched_signals: Any = None
        self._stages = stages
        self._n_microbatches = microbatches
        self._schedule = schedule
        self._mesh: ReplicaMesh | None = None
        self._pipeline: Pipeline | None = None
        self._raw_losses: list[torch.Tensor] = []
        self._loss_scale = 1
        self._backward_done = False
        self._pending_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        self._activation_codec = activation_codec

    # ------------------------------------------------------------------ public
    @property
    def fgdiloco(self) -> FGDiLoCo | None:
        """The :class:`~fgdiloco.FGDiLoCo` of this replica (built in ``setup`` of ``fit``; None before). After
        ``fit`` it stays readable (``round``, ``last_round``, ``failed_exchanges_total``) but is closed."""
        return self._fgdiloco

    @property
    def config(self) -> FGDiLoCoConfig:
        """The settings this strategy gives every replica's :class:`~fgdiloco.FGDiLoCo`."""
        return self._config

    @property
    def fgdiloco_kwargs(self) -> dict[str, Any]:
        """The settings as a dict (``config.as_dict()``)."""
        return self._config.as_dict()

    @property
    def pipeline_stages(self) -> int:
        """S, the pipeline stages per replica (1: no pipeline, one process per replica)."""
        return self._stages

    @property
    def n_microbatches(self) -> int:
        """Microbatches per batch of :meth:`pipeline_step` (``None`` at construction means ``pipeline_stages``)."""
        return self._n_microbatches

    @property
    def mesh(self) -> ReplicaMesh | None:
        """The :class:`~fgdiloco.ReplicaMesh` (``replicas = world // pipeline_stages``); built in ``setup`` when
        ``pipeline_stages > 1``, else None."""
        return self._mesh

    @property
    def pipeline(self) -> Pipeline | None:
        """This rank's :class:`~fgdiloco.pipeline.Pipeline` (``pipeline_stages > 1``, after ``setup``), else None.
        ``pipeline.last_step`` holds the latest step's bubble and activation bytes."""
        return self._pipeline

    @property
    def replica(self) -> int:
        """This rank's replica index, ``global_rank // pipeline_stages`` (the ``DistributedSampler``'s rank)."""
        return self.global_rank // self._stages  # type: ignore[attr-defined]

    @property
    def stage(self) -> int:
        """This rank's pipeline stage, ``global_rank % pipeline_stages``."""
        return self.global_rank % self._stages  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The ``DistributedSampler`` is indexed by replica: every stage of a replica reads the same batches."""
        kwargs = dict(super().distributed_sampler_kwargs)  # type: ignore[misc]
        if self._stages > 1:
            kwargs.update(num_replicas=kwargs["num_replicas"] // self._stages, rank=self.replica)
        return kwargs

    def pipeline_step(self, inputs: Any, target: Any) -> torch.Tensor:
        """Forward and backward of this replica's batch through its pipeline, for ``training_step``.

        Call it on every rank with the whole batch (every stage of a replica gets the same one; stage 0 uses
        ``inputs``, the last stage ``target``). With ``pipeline_stages > 1`` the gradients are in this stage's
        ``.grad`` when it returns (those of the mean of :meth:`pipeline_loss` over ``n_microbatches`` equal
        microbatches, divided by ``accumulate_grad_batches`` under automatic optimisation, as Lightning's own
        backward would): return the loss from ``training_step`` and Lightning's backward becomes a no-op that
        still runs the ``on_before_backward`` / ``on_after_backward`` hooks. With ``pipeline_stages=1`` it is the
        module's forward and loss, and Lightning runs the backward as usual.

        Args:
            inputs: the batch's inputs ``[B, ...]`` (a tensor or tuple of tensors; ``B`` divisible by
                ``n_microbatches``).
            target: the batch's targets ``[B, ...]``.

        Returns:
            The batch's loss (a scalar): on every stage of the replica, broadcast from the last stage over the
            replica's pipeline group (one scalar per step), so ``self.log`` shows the replica's loss on any rank.
            Detached when ``pipeline_stages > 1``.

        Raises:
            RuntimeError: called before ``setup`` or outside ``fit``'s training.
            fgdiloco.pipeline.PipelineError: a stage of this replica is gone.
        """
        stage_module = self._stage_module()
        if self._stages == 1:
            return self.lightning_module.pipeline_loss(stage_module(*_as_tuple(inputs)), target)  # type: ignore
        pipe = self._require_pipeline("pipeline_step")
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = module.trainer
        self._loss_scale = trainer.accumulate_grad_batches if module.automatic_optimization else 1
        self._raw_losses = []
        params = [p for p in stage_module.parameters() if p.requires_grad]
        if module.automatic_optimization:
            # Lightning zeroes the gradients after training_step and before its backward: keep this batch's aside
            # and add them in backward(), so accumulation and zero_grad behave as without a pipeline
            earlier = [p.grad for p in params]
            for p in params:
                p.grad = None
        pipe.step(inputs, target)
        if module.automatic_optimization:
            self._pending_grads = [(p, p.grad) for p in params]
            for p, g in zip(params, earlier):
                p.grad = g
        loss = self._replica_loss(self._raw_losses)
        self._raw_losses = []
        self._backward_done = True
        return loss

    def pipeline_eval(self, inputs: Any, target: Any) -> torch.Tensor:
        """The batch's loss through the pipeline, forward only, for ``validation_step`` / ``test_step``: the same
        arguments and return value as :meth:`pipeline_step` (collective over the replica's stages), no gradients."""
        stage_module = self._stage_module()
        with torch.inference_mode(False), torch.no_grad():
            if self._stages == 1:
                return self.lightning_module.pipeline_loss(  # type: ignore[attr-defined]
                    stage_module(*_as_tuple(inputs)), target)
            pipe = self._require_pipeline("pipeline_eval")
            self._loss_scale = 1
            self._raw_losses = []
            pipe.eval_loss(inputs, target)
            loss = self._replica_loss(self._raw_losses)
            self._raw_losses = []
        return loss

    def _replica_loss(self, raw: list[torch.Tensor]) -> torch.Tensor:
        mesh = self._mesh
        assert mesh is not None
        device = self.root_device  # type: ignore[attr-defined]
        if mesh.is_last_stage:
            loss = torch.stack([r.detach().float() for r in raw]).mean().to(device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        dist.broadcast(loss, src=mesh.stage_ranks()[-1], group=mesh.pipeline_group)
        return loss

    def _pipeline_loss(self, output: Any, target: Any) -> torch.Tensor:
        """The Pipeline's ``loss_fn``: the module's ``pipeline_loss``, recorded unscaled, divided by the gradient
        accumulation (the Pipeline itself divides by ``n_microbatches``)."""
        raw = self.lightning_module.pipeline_loss(output, target)  # type: ignore[attr-defined]
        if not shape_inference():  # torch also computes a loss on uninitialised tensors while inferring shapes
            self._raw_losses.append(raw.detach())
        return raw / self._loss_scale if self._loss_scale != 1 else raw

    def _stage_module(self) -> torch.nn.Module:
        stage_module = getattr(self.lightning_module, PIPELINE_MODULE_ATTRIBUTE, None)  # type: ignore[attr-defined]
        if stage_module is None:
            raise RuntimeError("pipeline_step / pipeline_eval need the LightningModule's configure_pipeline_stage "
                               "hook and a set-up trainer (call them from training_step / validation_step)")
        return stage_module

    def _require_pipeline(self, what: str) -> Pipeline:
        if self._pipeline is None:
            raise RuntimeError(f"{what} runs inside trainer.fit / validate / test, after the strategy's setup")
        return self._pipeline

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fgdiloco"`` (popen launcher) and ``"fgdiloco_spawn"`` (``start_method="spawn"``)."""
        for name, start_method in (("fgdiloco", "popen"), ("fgdiloco_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"Factored Gossip DiLoCo (one process per replica, gossip outer rounds) with "
                            f"start_method '{start_method}'",
                override=True,
                start_method=start_method,
            )

    # ------------------------------------------------------------------ set-up and teardown
    def configure_ddp(self) -> None:
        """No ``DistributedDataParallel``: there is no per-step gradient all-reduce. Replicas start from rank 0's
        weights through FGDiLoCo's ``broadcast_init`` when the wrapper is built (skipped when resuming replicas)."""
        assert isinstance(self.model, self._namespace.LightningModule)

    def _check_world(self, world: int) -> None:
        if world % self._stages:
            raise ValueError(f"pipeline_stages={self._stages} must divide the number of processes ({world}): "
                             f"processes = replicas x pipeline_stages")

    def _configure_launcher(self) -> None:
        # the Trainer calls this once devices and nodes are known: fail when the Trainer is built
        self._check_world(self.num_nodes * self.num_processes)  # type: ignore[attr-defined]
        super()._configure_launcher()  # type: ignore[misc]

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self._check_world(self.world_size)  # type: ignore[attr-defined]

    def _ensure_stage(self) -> None:
        """Build this rank's stage from ``configure_pipeline_stage`` once, as the LightningModule's
        ``pipeline_module`` (before checkpoint restore, optimizer set-up and the move to the device)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is None or getattr(module, PIPELINE_MODULE_ATTRIBUTE, None) is not None:
            return
        hook = getattr(module, "configure_pipeline_stage", None)
        if hook is None:
            if self._stages > 1:
                raise TypeError(f"pipeline_stages={self._stages} needs a LightningModule with "
                                f"configure_pipeline_stage(stage, stages) -> nn.Module and pipeline_loss(output, "
                                f"target) -> Tensor; {type(module).__name__} has no configure_pipeline_stage")
            return  # a plain module: one process per replica, as without pipelines
        if not callable(getattr(module, "pipeline_loss", None)):
            raise TypeError(f"{type(module).__name__}.configure_pipeline_stage needs a pipeline_loss(output, "
                            f"target) -> Tensor method (the mean loss over a microbatch)")
        stage_module = hook(self.stage, self._stages)
        if not isinstance(stage_module, torch.nn.Module):
            raise TypeError(f"configure_pipeline_stage({self.stage}, {self._stages}) must return a torch.nn.Module, "
                            f"got {type(stage_module).__name__}")
        names = [n for n, _ in module.named_parameters()][:5]
        if names:
            raise ValueError(f"with configure_pipeline_stage, the LightningModule must hold no parameters of its "
                             f"own (the stage it returns becomes module.{PIPELINE_MODULE_ATTRIBUTE}); found "
                             f"{', '.join(names)}. Build the whole model inside the hook, not in __init__ or "
                             f"configure_model")
        setattr(module, PIPELINE_MODULE_ATTRIBUTE, stage_module)

    def setup(self, trainer: Any) -> None:
        self._ensure_stage()
        fitting = trainer.state.fn == self._namespace.trainer.states.TrainerFn.FITTING
        if self._stages > 1 and self.precision_plugin.__class__.__name__.endswith("MixedPrecision") and \
                getattr(self.precision_plugin, "scaler", None) is not None:  # type: ignore[attr-defined]
            raise ValueError("pipeline_stages > 1 does not support precision='16-mixed' (its GradScaler scales "
                             "Lightning's backward, which the pipeline runs itself); use 'bf16-mixed' or '32-true'")
        if self._stages > 1 and not fitting:
            # DDPStrategy.setup without its broadcast of rank 0's weights, which belong to stage 0 only
            self.accelerator.setup(trainer)  # type: ignore[attr-defined]
            self.precision_plugin.convert_module(self.model)  # type: ignore[attr-defined]
            self.model_to_device()  # type: ignore[attr-defined]
            self.setup_precision_plugin()  # type: ignore[attr-defined]
        else:
            super().setup(trainer)  # type: ignore[misc]
        if self._stages > 1:
            self._build_pipeline()
        if fitting:
            self._close_fgdiloco()  # a previous fit's wrapper (already closed at its teardown)
            self._fgdiloco = self._build_fgdiloco()
            self._unlock_training_steps(trainer)

    def _build_pipeline(self) -> None:
        if self._mesh is None:  # collective over the job, once; its groups outlive fit / validate calls
            self._mesh = ReplicaMesh(self.world_size // self._stages, self._stages,  # type: ignore[attr-defined]
                                     stage_timeout=self._config.stage_timeout)
        stage_module = self._stage_module()
        if self._pipeline is None or self._pipeline.module is not stage_module:
            self._pipeline = Pipeline(stage_module, self._mesh, self._pipeline_loss, self._n_microbatches,
                                      self._schedule, device=self.root_device,  # type: ignore[attr-defined]
                                      activation_codec=self._stage_activation_codec(stage_module))

    def _stage_activation_codec(self, stage_module: torch.nn.Module) -> Any:
        """This stage's activation codec: the LightningModule's ``configure_activation_codec(stage, stages)``, or
        the strategy's ``activation_codec`` (a codec, or a factory called with the stage module)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        hook = getattr(module, "configure_activation_codec", None)
        if hook is not None and self._activation_codec is not None:
            raise ValueError(f"{type(module).__name__}.configure_activation_codec and the strategy's "
                             f"activation_codec= both give the pipeline's activation codec; use one")
        if hook is not None:
            codec = hook(self.stage, self._stages)
            where = f"configure_activation_codec({self.stage}, {self._stages})"
        elif _is_codec_factory(self._activation_codec):
            codec = self._activation_codec(stage_module)
            where = f"activation_codec({type(stage_module).__name__})"
        else:
            return self._activation_codec
        try:
            resolve_activation_codec(codec)
        except TypeError as err:
            raise TypeError(f"{where} must return None or an activation codec: {err}") from None
        return codec

    def _build_fgdiloco(self) -> FGDiLoCo:
        optimizers = list(self.optimizers)  # type: ignore[attr-defined]
        if len(optimizers) != 1:
            raise ValueError(f"FGDiLoCoStrategy wraps exactly one inner optimizer over all trainable parameters; "
                             f"configure_optimizers() gave {len(optimizers)}")
        inner = getattr(optimizers[0], "_optimizer", optimizers[0])  # unwrap a LightningOptimizer
        resuming = self._resume_state is not None
        if self._stages > 1:  # this stage, gossiping with the same stage of the other replicas
            fgd = FGDiLoCo(self._stage_module(), inner, self._config, mesh=self._mesh,
                           broadcast_init=self._broadcast_init and not resuming)
        else:
            fgd = FGDiLoCo(self.lightning_module, inner, self._config,  # type: ignore[attr-defined]
                           broadcast_init=self._broadcast_init and not resuming)
        log.info("fgdiloco: rank %d built %r%s", fgd.rank, fgd, " (resuming replicas)" if resuming else "")
        return fgd

    def _unlock_training_steps(self, trainer: Any) -> None:
        """Replace Lightning's per-batch SIGTERM broadcast by a local check, so that a slow replica does not hold
        the others back between outer rounds, and its SIGTERM handler by one without its broadcast on the world
        group (:func:`_local_sigterm_notifier`). Only for Lightning versions that have them (>= 2.5.2)."""
        loop = trainer.fit_loop.epoch_loop
        version = Version(self._namespace.__version__.split("+")[0])
        if version < _SIGTERM_BROADCAST_SINCE or not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
            return
        exceptions = getattr(self._namespace.utilities, "exceptions", None)
        exception = getattr(exceptions, "SIGTERMException", None)
        loop._broadcast_sigterm_tensor = functools.partial(_local_sigterm_check, trainer, exception)
        self._patched_loop = loop
        connector = getattr(trainer, "_signal_connector", None)
        if callable(getattr(type(connector), "_sigterm_notifier_fn", None)):
            # the Trainer registers its SIGTERM handler after setup, with this attribute
            connector._sigterm_notifier_fn = functools.partial(_local_sigterm_notifier, connector)
            self._patched_signals = connector

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """With ``pipeline_stages > 1`` the backward already ran in :meth:`pipeline_step`: run only the
        precision plugin's and the hooks' parts around it (``on_before_backward`` / ``on_after_backward``)."""
        if self._stages == 1:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        if not self._backward_done:
            raise RuntimeError("with pipeline_stages > 1, training_step must compute its loss with "
                               "self.trainer.strategy.pipeline_step(inputs, target), which runs forward and "
                               "backward through the pipeline (extra loss terms belong in pipeline_loss)")
        self._backward_done = False
        self.pre_backward(closure_loss)  # type: ignore[attr-defined]
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)  # type: ignore
        with torch.no_grad():  # what loss.backward() would have accumulated
            for p, g in self._pending_grads:
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        self._pending_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)  # type: ignore
        self.post_backward(closure_loss)  # type: ignore[attr-defined]
        return closure_loss

    def _close_fgdiloco(self) -> None:
        if self._fgdiloco is not None:
            self._fgdiloco.close()

    def teardown(self) -> None:
        if self._patched_loop is not None:
            with contextlib.suppress(AttributeError):
                del self._patched_loop._broadcast_sigterm_tensor
            self._patched_loop = None
        if self._patched_signals is not None:
            with contextlib.suppress(AttributeError):
                del self._patched_signals._sigterm_notifier_fn
            self._patched_signals = None
        self._close_fgdiloco()
        self._resume_state = None
        self._backward_done = False
        self._pending_grads = []
        super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Rank 0 writes ``filepath`` (its replica + metadata), every other rank its part (module docstring).

        The parts go beside rank 0's ``filepath`` (broadcast): when the ranks' epochs differ in length,
        ``ModelCheckpoint`` names the same epoch-end checkpoint after each rank's own step (``step=12`` on rank 0,
        ``step=9`` on rank 1), and parts under rank-local names could not be resumed."""
        fgd = self._fgdiloco
        if fgd is not None and self.world_size > 1:  # type: ignore[attr-defined]
            own = os.fspath(filepath)
            filepath = self.broadcast(own, src=0)  # type: ignore[attr-defined]
            self._saved_as[own] = filepath
        if fgd is not None:
            full = "optimizer_states" in checkpoint  # False for weights-only checkpoints
            state = None
            if full:
                state = fgd.state_dict()
                state.pop("inner")  # it is optimizer_states[0]
            checkpoint[CHECKPOINT_KEY] = {
                "format": CHECKPOINT_FORMAT,
                "world_size": self.world_size,  # type: ignore[attr-defined]
                "replicas": os.path.basename(os.fspath(filepath)) + ".replicas",
                "state": state,
            }
            if self._stages > 1:
                checkpoint[CHECKPOINT_KEY].update(stages=self._stages, replica=self.replica, stage=self.stage)
            if self.global_rank != 0:  # type: ignore[attr-defined]
                part = {
                    "format": CHECKPOINT_FORMAT,
                    "rank": self.global_rank,  # type: ignore[attr-defined]
                    "world_size": self.world_size,  # type: ignore[attr-defined]
                    "global_step": checkpoint.get("global_step"),
                    "state_dict": checkpoint["state_dict"],
                    CHECKPOINT_KEY: state,
                }
                if self._stages > 1:
                    part.update(stages=self._stages, replica=self.replica, stage=self.stage)
                for key, value in checkpoint.items():
                    if key == "optimizer_states" or key.endswith("Precision") or key.endswith("PrecisionPlugin"):
                        part[key] = value
                self.checkpoint_io.save_checkpoint(  # type: ignore[attr-defined]
                    part, replica_checkpoint_path(filepath, self.global_rank),  # type: ignore[attr-defined]
                    storage_options=storage_options)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def remove_checkpoint(self, filepath: Any) -> None:
        """Global rank 0 removes the checkpoint ``filepath`` whole: the file and its ``filepath.replicas`` folder
        (every rank's part, through ``checkpoint_io.remove_checkpoint``); the other ranks remove nothing.

        Rank 0's choice governs because the ranks' choices can differ: ``ModelCheckpoint(save_top_k=k)`` on a
        metric logged without ``sync_dist`` makes the ranks agree on *whether* to save, but each drops its own
        k-th best checkpoint, so ranks removing their own parts left checkpoints without a part and parts without a
        checkpoint. No collective runs here (``ModelCheckpoint`` may call this on some ranks only, e.g. on the
        rank whose dropped path is the one ``fit`` resumed from). Like ``ModelCheckpoint``, this assumes that
        rank 0 sees every rank's part: the checkpoint folder is on a filesystem shared by all nodes (resuming needs
        that too: every rank reads ``filepath``).

        Raises:
            OSError: from ``checkpoint_io`` when a file or the folder exists but cannot be removed (rank 0).
        """
        filepath = self._saved_as.pop(os.fspath(filepath), filepath)  # where save_checkpoint really put it
        if self.global_rank != 0:  # type: ignore[attr-defined]
            return
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        self.checkpoint_io.remove_checkpoint(  # type: ignore[attr-defined]
            os.path.dirname(replica_checkpoint_path(filepath, 1)))  # the folder with every rank's part

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Read ``checkpoint_path``; when fitting, swap in this rank's own replica from its part (rank >= 1) and keep
        the FGDiLoCo state for :meth:`load_optimizer_state_dict`."""
        self._ensure_stage()  # the module's state_dict is its stage's: build it before Lightning restores it
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self._resume_state = None
        meta = checkpoint.get(CHECKPOINT_KEY)
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        fitting = trainer is not None and trainer.state.fn == self._namespace.trainer.states.TrainerFn.FITTING
        if not isinstance(meta, dict) or not (fitting or self._stages > 1):
            return checkpoint  # outside fit, one stage: rank 0's replica everywhere (DDP's set-up)
        world, rank = self.world_size, self.global_rank  # type: ignore[attr-defined]
        if meta.get("world_size") != world:
            raise ValueError(
                f"{checkpoint_path} holds {meta.get('world_size')} FGDiLoCo workers, this run has {world} "
                "processes; resume with the same number, or start a new run from rank 0's replica with "
                "LightningModule.load_from_checkpoint(...)")
        if meta.get("stages", 1) != self._stages:
            raise ValueError(f"{checkpoint_path} holds replicas of {meta.get('stages', 1)} pipeline stages, this "
                             f"run has pipeline_stages={self._stages}; resume with the same pipeline_stages")
        if rank == 0:
            state = meta.get("state")
        else:
            part_path = replica_checkpoint_path(checkpoint_path, rank)
            try:
                part = self.checkpoint_io.load_checkpoint(part_path, weights_only=weights_only)  # type: ignore
            except FileNotFoundError as e:
                raise FileNotFoundError(f"rank {rank}'s part of {checkpoint_path} is missing: {part_path}") from e
            if part.get("rank") != rank or part.get("world_size") != world:
                raise ValueError(f"{part_path} belongs to rank {part.get('rank')} of {part.get('world_size')}, "
                                 f"not rank {rank} of {world}")
            for key, value in part.items():
                if key not in ("format", "rank", "world_size", "global_step", "stages", "replica", "stage",
                               CHECKPOINT_KEY):
                    checkpoint[key] = value
            state = part.get(CHECKPOINT_KEY)
        self._resume_state = state if fitting else None
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
        if self._resume_state is not None and self._fgdiloco is not None:
            state = dict(self._resume_state)
            state["inner"] = checkpoint["optimizer_states"][0]
            self._fgdiloco.load_state_dict(state)
        self._resume_state = None


# ---------------------------------------------------------------------- one concrete class per Lightning namespace
try:
    import pytorch_lightning as _pl
    from pytorch_lightning.strategies import DDPStrategy as _PLDDPStrategy
except ImportError:  # pragma: no cover - pytorch-lightning is a dependency
    _pl = None

try:
    import lightning.pytorch as _lpt
    from lightning.pytorch.strategies import DDPStrategy as _LDDPStrategy
except ImportError:
    _lpt = None


if _pl is not None:

    class FGDiLoCoStrategy(_FGDiLoCoStrategyMixin, _PLDDPStrategy):
        """Factored Gossip DiLoCo for ``pytorch_lightning``: ``Trainer(strategy="fgdiloco")``.

        One process per replica (DDP's launchers, process-group set-up and ``DistributedSampler``), but no
        ``DistributedDataParallel``: the optimizer from ``configure_optimizers()`` is the inner optimizer and
        runs on each replica alone; every ``sync_every`` real optimizer steps (gradient accumulation and manual
        optimisation included; a step skipped by a ``GradScaler`` does not count) the outer round of
        :class:`fgdiloco.FGDiLoCo` runs. LR schedulers keep stepping the inner optimizer.

        Between rounds the replicas do not wait for each other: Lightning's per-batch SIGTERM broadcast
        (Lightning >= 2.5.2) is replaced by a local check while fitting, and so is the broadcast in its SIGTERM
        handler (a rank sent SIGTERM posts FGDiLoCo's departure notice and exits at once). What a death does to the
        job, under Lightning's launcher and under ``torchrun --max-restarts``: docs/lightning.md, "When a process
        dies". Keep it that way in your own code: do not
        log with ``sync_dist=True`` in ``training_step`` (it adds a collective per step), and note that
        validation, ``EarlyStopping`` and checkpointing synchronise all ranks when they run.

        :attr:`fgdiloco` is this replica's wrapper (``last_round``: the diagnostics of the last round, see
        :class:`lightning_callbacks.GossipMonitor`). Checkpoints hold every replica's state: see the module
        docstring of :mod:`lightning_callbacks.strategy` for the file layout.

        Example::

            trainer = Trainer(strategy="fgdiloco", accelerator="cpu", devices=4)
            trainer = Trainer(strategy=FGDiLoCoStrategy(sync_every=100, topology="exponential"), devices=8)
            trainer = Trainer(strategy=FGDiLoCoStrategy(pipeline_stages=2, n_microbatches=4), devices=8)  # 4 x 2

        Args:
            config, **settings: the FGDiLoCo settings (:class:`fgdiloco.FGDiLoCoConfig`, its fields by name
                override it: ``sync_every=100``, ``codec="lowrank"``, ``timeout=30``), the same object and defaults
                as :class:`fgdiloco.FGDiLoCo`. All ranks of the job gossip (the default process group).
            broadcast_init: as in :class:`fgdiloco.FGDiLoCo`.
            pipeline_stages: S, pipeline stages per replica (int >= 1 dividing the number of processes; default 1:
                one process per replica, no pipeline). With S > 1 the LightningModule implements the pipeline
                contract (module docstring of :mod:`lightning_callbacks.strategy`) and the gossip runs among the
                same stage of the ``world // S`` replicas; stage-to-stage sends are bounded by ``stage_timeout``.
            n_microbatches: microbatches per batch (int >= 1; >= S for "1f1b"; default: S).
            pipeline_schedule: ``"1f1b"`` (default) or ``"gpipe"``, as in :class:`fgdiloco.pipeline.Pipeline`.
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, start_method:
                as in ``DDPStrategy`` (normally filled in by the Trainer).
            process_group_backend: as in ``DDPStrategy``: None (Lightning picks ``"nccl"`` on CUDA, ``"gloo"``
                otherwise), a backend ``torch.distributed`` knows (``torch.distributed.Backend.backend_list``:
                ``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``, ``"xccl"``, and any registered with
                ``Backend.register_backend`` before the strategy is built), or per-device pairs
                (``"cpu:gloo,cuda:nccl"``).
            process_group_timeout: DDP's ``timeout`` of the default process group: a positive
                ``datetime.timedelta``, or None (torch's default).
            activation_codec: what crosses the stage boundaries with ``pipeline_stages > 1``, as
                :class:`fgdiloco.pipeline.Pipeline`'s ``activation_codec``: None (default: the activations as they
                are), a codec used on every stage, or a callable ``stage_module -> codec`` called once with this
                rank's stage, e.g. ``activation_codec=fgdiloco.pretrain.activation_codec_for`` for a subspace GPT
                (k numbers per token each way). The LightningModule hook ``configure_activation_codec(stage,
                stages)`` does the same per module; not both.

        Raises:
            TypeError, ValueError: a wrong argument, when the strategy (or ``Trainer``) is built, with FGDiLoCo's
                message (a ``process_group_timeout`` that is not a ``timedelta``, e.g. ``30``, is a ``TypeError``;
                an unknown ``process_group_backend`` a ``ValueError``); ``pipeline_stages`` that does not divide
                the processes when the ``Trainer`` is built.
        """

        _namespace = _pl

    def _register_pytorch_lightning() -> None:
        from pytorch_lightning.strategies import StrategyRegistry

        FGDiLoCoStrategy.register_strategies(StrategyRegistry)


if _lpt is not None:

    class LightningFGDiLoCoStrategy(_FGDiLoCoStrategyMixin, _LDDPStrategy):
        """:class:`FGDiLoCoStrategy` for the unified ``lightning`` package (``lightning.pytorch``)."""

        _namespace = _lpt

    def _register_lightning() -> None:
        from lightning.pytorch.strategies import StrategyRegistry

        LightningFGDiLoCoStrategy.register_strategies(StrategyRegistry)

    if _pl is None:  # pragma: no cover
        FGDiLoCoStrategy = LightningFGDiLoCoStrategy


def _registration_hook() -> None:
    import sys

    from ._register import strategy_loaded

    strategy_loaded(sys.modules[__name__])


_registration_hook()  # keep last: registers the classes defined above

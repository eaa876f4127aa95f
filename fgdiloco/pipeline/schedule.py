"""``Pipeline``: one replica's stage of a pipeline-parallel model, on ``torch.distributed.pipelining``.

Every rank of a :class:`~fgdiloco.mesh.ReplicaMesh` builds one :class:`Pipeline` around its stage module; the S
ranks of a replica then run each batch as ``n_microbatches`` microbatches through a GPipe (fill-drain) or 1F1B
schedule over the replica's pipeline group. The training loop is the same on every rank::

    pipe = Pipeline(stage_module, mesh, loss_fn, n_microbatches=4)
    opt = FGDiLoCo(stage_module, torch.optim.AdamW(stage_module.parameters()), sync_every=H, mesh=mesh)
    for x, y in loader:                  # the replica's batch (every stage may pass it; each uses its part)
        loss = pipe.step(x, y)           # forward + backward; the loss on the last stage, None elsewhere
        opt.step()
        opt.zero_grad()
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..gossip.staging import HostBoundary
from ..mesh import ReplicaMesh
from .codec import BoundaryModule, _inferring_shapes, needs_inputs, resolve_activation_codec

__all__ = ["SCHEDULES", "Pipeline", "PipelineError", "PipelineStats"]

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class PipelineError(RuntimeError):
    """A stage-to-stage transfer failed: a stage of this replica is dead, hung or stopped.

    Attributes:
        ranks: global ranks of this replica's stages that are gone (dead, hung or stopped).
        rank: the first of them.
    """

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = list(ranks)
        self.rank = self.ranks[0] if self.ranks else None


@dataclass
class PipelineStats:
    """One :meth:`Pipeline.step` of this stage.

    Attributes:
        step: index of the step (0-based).
        microbatches: microbatches the batch was split into.
        seconds: wall time of the step.
        compute_seconds: time this stage spent computing (forward, backward and, on the last stage, the loss).
        bubble: ``1 - compute_seconds / seconds``, the fraction of the step the stage waited for its neighbours
            (transfers included). The first step also holds the schedule's one-off shape inference.
        forward_bytes_sent: activation bytes sent to the next stage (what the activation codec encodes).
        backward_bytes_sent: gradient bytes sent to the previous stage.
        bytes_received: activation and gradient bytes received.
    """

    step: int
    microbatches: int
    seconds: float
    compute_seconds: float
    bubble: float
    forward_bytes_sent: int
    backward_bytes_sent: int
    bytes_received: int

    @property
    def activation_bytes_sent(self) -> int:
        """Forward activations + backward gradients sent in this step."""
        return self.forward_bytes_sent + self.backward_bytes_sent

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "activation_bytes_sent": self.activation_bytes_sent}


def _nbytes(ops: list[dist.P2POp]) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


class _Stage(PipelineStage):
    """A ``PipelineStage`` that counts what it sends and receives and times its compute."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.reset_counters()
        self.compute_failed = False
        self.model_error: Exception | None = None

    def _move_submod_to_device(self) -> None:
        if not isinstance(self.submod, HostBoundary):  # a staged stage computes on its GPU, not on self.device
            super()._move_submod_to_device()

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # shapes are inferred on uninitialised tensors: codecs skip value checks (codec.shape_inference())
        with _inferring_shapes():
            return super()._forward_metadata_inference(*args, **kwargs)

    def _backward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        # the last stage calls loss_fn on those tensors here: a loss_fn that records its losses must skip this one
        with _inferring_shapes():
            return super()._backward_metadata_inference(*args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        # torch wraps a forward error in a RuntimeError; keep the model's own exception to re-raise it unchanged
        try:
            return super().forward_maybe_with_nosync(*args, **kwargs)
        except Exception as err:
            self.model_error = err
            raise

    def reset_counters(self) -> None:
        self.fwd_bytes = self.bwd_bytes = self.recv_bytes = 0
        self.compute_seconds = 0.0

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self.recv_bytes += _nbytes(ops)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self.recv_bytes += _nbytes(ops)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.fwd_bytes += _nbytes(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.bwd_bytes += _nbytes(ops)
        return ops

    def _timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            self.compute_failed = True
            model_error, self.model_error = self.model_error, None
            if model_error is not None and model_error is not err:
                raise model_error from None  # the model's own error (e.g. SubspaceError), not torch's wrapper
            raise
        finally:
            self.compute_seconds += time.perf_counter() - t0

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().backward_one_chunk, *args, **kwargs)


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


class Pipeline:
    """This rank's stage of its replica's pipeline, run with a ``torch.distributed.pipelining`` schedule.

    Collective over the replica's pipeline group: its S stages build their ``Pipeline`` and call :meth:`step` /
    :meth:`eval_loss` together. Each batch is split along dim 0 into ``n_microbatches`` equal microbatches; with
    ``loss_fn`` a mean over its microbatch, the gradients left in ``stage_module``'s ``.grad`` equal those of the
    unsplit model's mean loss over the whole batch (each microbatch's loss is divided by ``n_microbatches`` before
    its backward, so gradients accumulate into ``.grad`` like a plain ``loss.backward()``: zero them between steps).
    The schedule infers the shapes crossing the stage boundaries from the first batch (and again after each switch
    between :meth:`step` and :meth:`eval_loss`), so batches of one kind must keep one shape.

    Faults: every stage-to-stage transfer has the mesh's ``timeout``. A dead neighbour makes the transfer fail at
    once, a hung or stopped one after ``timeout`` seconds; either way :meth:`step` raises :class:`PipelineError`
    naming the lost rank, and this pipeline cannot be used again (its group's connections are closed). Other
    replicas are not affected: their pipelines use other groups, and gossip with this replica's ranks fails and is
    counted like any failed exchange. Errors raised by the model itself (forward, backward, loss) propagate
    unchanged. In a pipeline of more than two stages every stage of the replica stops, each naming the rank that
    is gone: the failing stages announce themselves in the job's store and wait for each other. A stage whose
    neighbour is alive but stuck in a transfer with the lost rank fails only when its own transfer times out, so
    there every stage stops within about ``timeout``, even for a dead rank.

    Args:
        stage_module: this rank's stage (e.g. one of :meth:`fgdiloco.pretrain.GPT.split`); on the first stage it
            takes the batch's inputs, on the last its output goes to ``loss_fn``.
        mesh: the :class:`~fgdiloco.mesh.ReplicaMesh`; ``mesh.stage`` is this module's stage index.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage, a mean over the microbatch (e.g.
            ``F.mse_loss``, or cross-entropy of logits ``[b, T, V]`` against ``[b, T]`` token ids).
        n_microbatches: microbatches per batch (int >= 1; >= ``mesh.stages`` for ``"1f1b"``). More microbatches
            shrink the bubble, ``(S - 1) / (m + S - 1)`` of a step for equal stages, at the price of smaller
            matrix products.
        schedule: ``"1f1b"`` (default: one forward, one backward in the steady state; holds at most S microbatches'
            activations) or ``"gpipe"`` (all forwards, then all backwards; holds all m).
        activation_codec: ``None`` (send activations as they are), an :class:`~fgdiloco.pipeline.ActivationCodec`
            or an ``(encode, decode)`` pair (see :mod:`fgdiloco.pipeline.codec`): ``encode`` wraps this stage's
            output unless it is the last stage, ``decode`` the received input unless it is the first.
        device: where the stage computes (default: the current CUDA device on an NCCL mesh, else the CPU). A CUDA
            stage on a Gloo pipeline group (stages sharing GPUs, or a Gloo job) sends and receives through the host
            (:class:`fgdiloco.gossip.staging.HostBoundary`).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``n_microbatches`` < 1 (or < ``mesh.stages`` for ``"1f1b"``), an unknown ``schedule``.

    Attributes:
        last_step: :class:`PipelineStats` of the latest :meth:`step`.
        activation_bytes_sent_total: forward + backward bytes this stage sent over all steps.
        steps: steps taken.
    """

    def __init__(self, stage_module: nn.Module, mesh: ReplicaMesh, loss_fn: Callable[[Any, Any], torch.Tensor],
                 n_microbatches: int, schedule: str = "1f1b", *, activation_codec: Any = None,
                 device: torch.device | str | None = None):
        if not isinstance(stage_module, nn.Module):
            raise TypeError(f"stage_module must be a torch.nn.Module, got {type(stage_module).__name__}")
        if not isinstance(mesh, ReplicaMesh):
            raise TypeError(f"mesh must be a fgdiloco.ReplicaMesh, got {type(mesh).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> loss, got {type(loss_fn).__name__}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
            raise TypeError(f"n_microbatches must be an int >= 1, got {type(n_microbatches).__name__}")
        if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        schedule = schedule.lower()
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches}")
        if schedule == "1f1b" and n_microbatches < mesh.stages:
            raise ValueError(f"n_microbatches must be >= stages ({mesh.stages}) for the 1f1b schedule, got "
                             f"{n_microbatches}; use more microbatches or schedule='gpipe'")
        codec = resolve_activation_codec(activation_codec)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
        self.device = torch.device(device)
        self.mesh = mesh
        self.module = stage_module
        self.loss_fn = loss_fn
        self.n_microbatches = n_microbatches
        self.schedule_name = schedule
        self.is_first = mesh.stage == 0
        self.is_last = mesh.stage == mesh.stages - 1
        encode = decode = owner = None
        self.codec_needs_inputs = codec is not None and needs_inputs(activation_codec)
        if codec is not None:
            encode, decode, owner = codec
            encode = None if self.is_last else encode
            decode = None if self.is_first else decode
        self._runner = BoundaryModule(stage_module, encode, decode, owner, with_inputs=self.codec_needs_inputs,
                                      first=self.is_first)
        #: the stage's boundary tensors go through the host: a CUDA stage on a Gloo pipeline group
        self.staged = self.device.type != "cpu" and dist.get_backend(mesh.pipeline_group) != "nccl"
        runner = HostBoundary(self._runner, self.device, last=self.is_last) if self.staged else self._runner
        wire = torch.device("cpu") if self.staged else self.device  # where the transfers' tensors live
        self._stage = _Stage(runner, mesh.stage, mesh.stages, wire, group=mesh.pipeline_group)
        self._schedule = SCHEDULES[schedule](self._stage, n_microbatches, loss_fn=self._scaled_loss,
                                             scale_grads=False)
        self._neighbours = [mesh.rank_of(mesh.replica, s) for s in (mesh.stage - 1, mesh.stage + 1)
                            if 0 <= s < mesh.stages]
        # a run nonce for the store keys of failure reports (a reused store's old keys can never match)
        nonce = torch.tensor([secrets.randbits(62) if self.is_first else 0], dtype=torch.int64, device=wire)
        dist.broadcast(nonce, src=mesh.stage_ranks()[0], group=mesh.pipeline_group)
        self._namespace = f"fgdiloco/pipeline/{int(nonce.item()):x}"
        self._broken: PipelineError | None = None
        self.last_step: PipelineStats | None = None
        self.activation_bytes_sent_total = 0
        self.steps = 0

    @property
    def timeout(self) -> float:
        """Seconds a stage-to-stage transfer may take (the mesh's ``timeout``)."""
        return self.mesh.timeout

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.loss_fn(output, target) / self.n_microbatches
        except Exception:
            self._stage.compute_failed = True
            raise
        finally:
            self._stage.compute_seconds += time.perf_counter() - t0

    def _check_batch(self, inputs: Any, target: Any) -> tuple[tuple[Any, ...], Any, dict[str, Any]]:
        if self._broken is not None:
            raise PipelineError(f"this pipeline is broken by an earlier failure: {self._broken}", self._broken.ranks)
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if self.is_first or self.codec_needs_inputs:
            if inputs is None:
                raise ValueError("inputs are required on the first stage" if self.is_first else
                                 "inputs are required on every stage: the activation codec reads them "
                                 "(needs_inputs=True; e.g. the token ids of the subspace codec)")
            args = _as_tuple(inputs)
            for a in args:
                if not isinstance(a, torch.Tensor) or a.dim() == 0 or a.shape[0] % self.n_microbatches:
                    raise ValueError(f"inputs must be tensors whose dim 0 (the batch) is divisible by "
                                     f"n_microbatches={self.n_microbatches}, got "
                                     f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
            if not self.is_first:  # read locally by the codec, split into microbatches like the inputs
                kwargs = {"inputs": inputs}
                args = ()
        bad_target = not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] % self.n_microbatches
        if self.is_last and bad_target:
            raise ValueError(f"target must be a tensor whose dim 0 (the batch) is divisible by "
                             f"n_microbatches={self.n_microbatches} on the last stage, got "
                             f"{tuple(target.shape) if isinstance(target, torch.Tensor) else target!r}")
        return args, (target if self.is_last else None), kwargs

    def _missing_ranks(self) -> list[int]:
        """The stages of this replica that are gone, told apart from those that are alive but failed with us.

        Gloo's error names an address, not a rank, and one failed pair fails every pending transfer of the rank
        in that group, so which transfer failed says little in a pipeline of more than two stages. Instead every
        stage that fails announces itself (with the time) in the job's store and waits for the others'
        announcements until at most one other stage is silent: that one is lost. A living stage stuck in a
        transfer with a living neighbour announces when its own transfer times out, so this takes up to about
        ``timeout``. Should two or more stay silent (several lost at once), they are all named once
        ``timeout + min(timeout, 2 s)`` has passed since the first announcement. With two stages the neighbour
        is the only candidate and nothing is waited for.
        """
        m = self.mesh
        others = [r for r in m.stage_ranks() if r != m.rank]
        key = f"{self._namespace}/failed/{{}}".format
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(key(m.rank), repr(time.time()))
            if len(others) == 1:
                return others
            deadline = None
            while True:  # polls the store; runs only on the way to raising, never in training
                silent = [r for r in others if not store.check([key(r)])]
                if len(silent) <= 1:
                    return silent
                if deadline is None:
                    first = min(float(store.get(key(r))) for r in [m.rank, *others] if r not in silent)
                    deadline = first + self.timeout + min(self.timeout, 2.0)
                if time.time() >= deadline:
                    return silent
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store went with a dead rank: fall back to the neighbours
            return self._neighbours

    def _failure(self, err: Exception) -> PipelineError:
        m = self.mesh
        missing = self._missing_ranks() or self._neighbours
        who = ", ".join(f"rank {r} (stage {r % m.stages} of replica {m.replica})" for r in missing)
        msg = (f"pipeline transfer of replica {m.replica} failed on rank {m.rank} (stage {m.stage}): {who} "
               f"{'is' if len(missing) == 1 else 'are'} dead, hung or stopped (no answer within the mesh timeout "
               f"of {m.timeout:g} s, or its connection closed); this replica cannot continue. "
               f"Cause: {type(err).__name__}: {str(err)[:300]}")
        self._broken = PipelineError(msg, missing)
        return self._broken

    def _run(self, call: Callable[[], Any]) -> None:
        self._stage.compute_failed = False
        try:
            call()
        except Exception as err:
            if self._stage.compute_failed:
                raise
            raise self._failure(err) from err

    def step(self, inputs: Any = None, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward and backward of one batch through the replica's pipeline.

        Args:
            inputs: the batch's inputs, ``[B, ...]`` (a tensor or a tuple of tensors, B divisible by
                ``n_microbatches``); used on the first stage, and on every stage when the activation codec
                ``needs_inputs`` (read locally, not sent); ignored elsewhere.
            target: the batch's targets, ``[B, ...]``; used on the last stage, ignored elsewhere.

        Returns:
            On the last stage, the batch's loss (a detached scalar tensor: the mean of the microbatches' losses);
            ``None`` on the other stages. Gradients are accumulated into the stage module's ``.grad``.

        Raises:
            PipelineError: a neighbouring stage is dead, hung or stopped (see the class docstring).
            ValueError: missing inputs (first stage) or target (last stage), or a batch not divisible into
                ``n_microbatches``.
        """
        args, target, kwargs = self._check_batch(inputs, target)
        self._stage.reset_counters()
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        t0 = time.perf_counter()
        self._run(lambda: self._schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs))
        seconds = time.perf_counter() - t0
        s = self._stage
        compute = min(s.compute_seconds, seconds)
        self.last_step = PipelineStats(
            step=self.steps, microbatches=self.n_microbatches, seconds=seconds, compute_seconds=compute,
            bubble=1.0 - compute / seconds if seconds > 0 else 0.0, forward_bytes_sent=s.fwd_bytes,
            backward_bytes_sent=s.bwd_bytes, bytes_received=s.recv_bytes)
        self.activation_bytes_sent_total += self.last_step.activation_bytes_sent
        self.steps += 1
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    @torch.no_grad()
    def eval_loss(self, inputs: Any = None, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """The batch's loss through the pipeline, forward only (no gradients, parameters untouched): for held-out
        evaluation. Same arguments, return value and errors as :meth:`step`. Collective over the replica's stages.
        Switching between :meth:`step` and :meth:`eval_loss` costs one small metadata exchange between stages."""
        args, target, kwargs = self._check_batch(inputs, target)
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        self._run(lambda: self._schedule.eval(*args, target=target, losses=losses, **kwargs))
        if losses is None:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()

    def __repr__(self) -> str:
        m = self.mesh
        return (f"Pipeline(stage={m.stage}/{m.stages}, replica={m.replica}, schedule={self.schedule_name!r}, "
                f"n_microbatches={self.n_microbatches})")

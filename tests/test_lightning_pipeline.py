"""Lightning with pipeline stages: ``FGDiLoCoStrategy(pipeline_stages=S, n_microbatches=m)``.

The multi-process runs start ``tests/lightning_scripts/train.py --stages 2`` on 4 CPU processes (2 replicas x 2
stages of the script's MLP, split as ``[Linear, Tanh] | [Linear]``), like ``tests/test_lightning.py`` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from fgdiloco.testing import run_ranks
from lightning_callbacks import FGDiLoCoStrategy
from lightning_callbacks.strategy import CHECKPOINT_KEY, replica_checkpoint_path
from tests.lightning_scripts.train import HIDDEN, IN
from tests.test_lightning import _launch, _plain_wrapper

STAGE0 = IN * HIDDEN + HIDDEN  # parameters of [Linear(IN, HIDDEN), Tanh]; the rest ([Linear(HIDDEN, 1)]) is stage 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(pipeline_stages=0), ValueError, "pipeline_stages"),
        (dict(pipeline_stages=2.0), TypeError, "pipeline_stages"),
        (dict(pipeline_stages=True), TypeError, "pipeline_stages"),
        (dict(pipeline_stages=2, n_microbatches=0), ValueError, "n_microbatches"),
        (dict(pipeline_stages=2, n_microbatches="4"), TypeError, "n_microbatches"),
        (dict(pipeline_stages=2, n_microbatches=1), ValueError, "n_microbatches must be >= pipeline_stages"),
        (dict(pipeline_stages=2, pipeline_schedule="zigzag"), ValueError, "pipeline_schedule"),
    ],
)
def test_wrong_pipeline_arguments_fail_when_built(kwargs, error, match):
    with pytest.raises(error, match=match):
        FGDiLoCoStrategy(**kwargs)


def test_stages_must_divide_the_processes_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"pipeline_stages=3 must divide the number of processes \(4\)"):
        pl.Trainer(strategy=FGDiLoCoStrategy(pipeline_stages=3), accelerator="cpu", devices=4, logger=False)
    strategy = FGDiLoCoStrategy(pipeline_stages=2, n_microbatches=None, pipeline_schedule="GPipe")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=4, logger=False)
    assert trainer.strategy.pipeline_stages == 2 and trainer.strategy.n_microbatches == 2  # default: S
    assert trainer.strategy.mesh is None and trainer.strategy.pipeline is None  # built in setup()
    assert FGDiLoCoStrategy().pipeline_stages == 1


def _split(flat: torch.Tensor, stage: int) -> torch.Tensor:
    return flat[:STAGE0] if stage == 0 else flat[STAGE0:]


@pytest.mark.slow
def test_two_by_two_equals_diloco_of_the_unsplit_model_and_resumes_the_same_trajectory(tmp_path):
    """4 processes = 2 replicas x 2 stages, exact all-reduce outer rounds. 96 samples / (2 replicas x 8) = 6 steps
    per epoch; 2 epochs = 12 steps = rounds at steps 5 and 10, then 2 steps into round 3 (replicas differ).

    * Every stage equals the matching slice of a plain 2-replica DiLoCo of the unsplit model (whose sampler is
      ``DistributedSampler(num_replicas=2, rank=replica)``) after every round and at the end: the pipeline's
      gradients are the unsplit model's, and both stages of a replica read the replica's shard.
    * The logged ``train_loss`` / ``val_loss`` (``pipeline_eval`` in ``validation_step``) are the replica's on both
      of its stages.
    * Every rank writes its own part of the epoch-0 checkpoint; ``fit(ckpt_path=...)`` in new processes restores
      each (replica, stage) and continues the uninterrupted run's trajectory; ``validate(ckpt_path=...)`` then
      loads every rank's own part of the final checkpoint.
    """
    common = ("--stages", "2", "--microbatches", "2", "--topology", "allreduce", "--sync-every", "5",
              "--samples", "96", "--max-epochs", "2", "--val")
    full = _launch(tmp_path / "full", *common, "--ckpt-dir", str(tmp_path / "ckpt"), "--keep-checkpoints",
                   devices=4)
    reference = run_ranks(_plain_wrapper, 2, tmp_path, 96, 8, 2, 5, 0)

    for rank, out in enumerate(full):
        replica, stage = divmod(rank, 2)
        assert (out["replica"], out["stage"]) == (replica, stage)
        assert out["rounds"] == 2 and out["global_step"] == 12 and out["failed_exchanges_total"] == 0
        assert out["final_params"].numel() == (STAGE0 if stage == 0 else HIDDEN + 1)  # only its own stage
        for k in range(2):
            torch.testing.assert_close(out["round_params"][k], _split(reference[replica][0][k], stage),
                                       rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["final_params"], _split(reference[replica][1], stage), rtol=1e-5, atol=1e-6)
    for replica in range(2):  # the replica's loss on both its stages
        first, last = full[2 * replica]["callback_metrics"], full[2 * replica + 1]["callback_metrics"]
        for key in ("train_loss", "val_loss"):
            assert first[key] == last[key] and 0 < first[key] < 10, key
    assert full[0]["callback_metrics"]["train_loss"] != full[2]["callback_metrics"]["train_loss"]
    assert not torch.allclose(full[0]["final_params"], full[2]["final_params"])  # 2 steps after the last round

    ckpt = tmp_path / "ckpt" / "epoch=0.ckpt"
    assert ckpt.is_file() and all(Path(replica_checkpoint_path(ckpt, r)).is_file() for r in (1, 2, 3))
    meta = torch.load(ckpt, weights_only=False)[CHECKPOINT_KEY]
    assert (meta["world_size"], meta["stages"], meta["replica"], meta["stage"]) == (4, 2, 0, 0)
    part = torch.load(replica_checkpoint_path(ckpt, 3), weights_only=False)
    assert (part["rank"], part["replica"], part["stage"], part["global_step"]) == (3, 1, 1, 6)
    assert sum(t.numel() for t in part["state_dict"].values()) == HIDDEN + 1  # stage 1's weights only
    assert part[CHECKPOINT_KEY]["round"] == 1 and part["optimizer_states"][0]["state"]  # FGDiLoCo + AdamW state

    end = tmp_path / "ckpt" / "epoch=1.ckpt"  # written after the last step: the final parameters
    resumed = _launch(tmp_path / "resumed", *common, "--resume", str(ckpt), "--validate-ckpt", str(end), devices=4)
    for replica in range(2):  # trainer.validate(ckpt_path=...) reads every rank's own part, copies nothing
        for stage in range(2):
            rank = 2 * replica + stage
            torch.testing.assert_close(resumed[rank]["validate"]["params"], full[rank]["final_params"], rtol=0,
                                       atol=0)
        first, last = (resumed[2 * replica + s]["validate"]["metrics"]["val_loss"] for s in range(2))
        assert first == last and 0 < first < 10
    for rank in range(4):
        assert resumed[rank]["rounds"] == 2 and resumed[rank]["global_step"] == 12
        assert len(resumed[rank]["round_params"]) == 1  # round 2 ended after the resume
        torch.testing.assert_close(resumed[rank]["round_params"][0], full[rank]["round_params"][1],
                                   rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(resumed[rank]["final_params"], full[rank]["final_params"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_gradient_accumulation_and_a_resume_with_other_pipeline_stages(tmp_path):
    """``accumulate_grad_batches=2`` of batches of 4 (2 microbatches of 2) is the plain unsplit DiLoCo with batches
    of 8: the pipeline's gradients survive Lightning's ``zero_grad`` and add up like its own backward. The 2 x 2
    checkpoint then cannot resume as 4 x 1 (its parts hold half-models): the error names ``pipeline_stages``."""
    common = ("--sync-every", "3", "--samples", "96", "--max-epochs", "1", "--topology", "allreduce")
    first = _launch(tmp_path / "first", *common, "--stages", "2", "--batch-size", "4", "--accumulate", "2",
                    "--ckpt-dir", str(tmp_path / "ckpt"), devices=4)
    reference = run_ranks(_plain_wrapper, 2, tmp_path, 96, 8, 1, 3, 0)
    for rank, out in enumerate(first):
        replica, stage = divmod(rank, 2)
        assert out["global_step"] == 6 and out["rounds"] == 2
        for k in range(2):
            torch.testing.assert_close(out["round_params"][k], _split(reference[replica][0][k], stage),
                                       rtol=1e-5, atol=1e-6)
    with pytest.raises(pytest.fail.Exception, match="pipeline_stages=1; resume with the same pipeline_stages"):
        _launch(tmp_path / "again", *common, "--resume", str(tmp_path / "ckpt" / "epoch=0.ckpt"), devices=4)


@pytest.mark.slow
def test_manual_optimisation_through_pipeline_step(tmp_path):
    """Manual optimisation: ``pipeline_step``, a no-op ``manual_backward`` (hooks only), ``opt.step()``: the same
    rounds as the plain unsplit DiLoCo."""
    first = _launch(tmp_path / "manual", "--sync-every", "3", "--samples", "96", "--topology", "allreduce",
                    "--stages", "2", "--manual", devices=4)
    reference = run_ranks(_plain_wrapper, 2, tmp_path, 96, 8, 1, 3, 0)
    for rank, out in enumerate(first):
        replica, stage = divmod(rank, 2)
        assert out["global_step"] == 6 and out["rounds"] == 2
        for k in range(2):
            torch.testing.assert_close(out["round_params"][k], _split(reference[replica][0][k], stage),
                                       rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- subspace codec
K = 4  # of the GPT's d = 32: its boundaries send K/d = 1/8 of the plain split's bytes


def _gpt_pipeline_reference(rank: int, world: int, samples: int, batch_size: int, epochs: int, sync_every: int,
                            stage_embeddings: bool = False) -> dict:
    """The Lightning run of ``train.py --gpt K`` as a plain loop: ``build_stage`` + ``Pipeline(activation_codec=
    activation_codec_for(stage))`` + ``FGDiLoCo(mesh=...)``, the replica's data order of Lightning's
    ``DistributedSampler``; then the plain split's bytes for one batch of the same shape."""
    from torch.utils.data import DataLoader, DistributedSampler

    from fgdiloco import FGDiLoCo, ReplicaMesh
    from fgdiloco.pipeline import Pipeline
    from fgdiloco.pretrain import activation_codec_for, lm_loss
    from tests.lightning_scripts.train import make_gpt_stage, make_inner_optimizer, make_token_dataset

    mesh = ReplicaMesh(2, 2, timeout=30.0)
    stage = make_gpt_stage(K, mesh.stage, 2, 0, stage_embeddings)
    pipe = Pipeline(stage, mesh, lm_loss, 2, "1f1b", activation_codec=activation_codec_for(stage))
    opt = FGDiLoCo(stage, make_inner_optimizer(stage.parameters()), sync_every=sync_every, topology="allreduce",
                   outer_lr=0.7, seed=0, timeout=30.0, mesh=mesh)
    data = make_token_dataset(samples)
    sampler = DistributedSampler(data, num_replicas=2, rank=mesh.replica, shuffle=True, seed=0)
    losses, sent = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(data, batch_size=batch_size, sampler=sampler):
            opt.zero_grad()
            loss = pipe.step(x, y)
            opt.step()
            losses.append(None if loss is None else float(loss))
            sent.append((pipe.last_step.forward_bytes_sent, pipe.last_step.backward_bytes_sent))
    opt.close()
    plain = make_gpt_stage(None, mesh.stage, 2, 0)
    plain_pipe = Pipeline(plain, mesh, lm_loss, 2, "1f1b")
    plain_pipe.step(x, y)
    plain_sent = (plain_pipe.last_step.forward_bytes_sent, plain_pipe.last_step.backward_bytes_sent)
    return {"losses": losses, "sent": sent, "plain_sent": plain_sent,
            "final_params": torch.cat([p.detach().reshape(-1) for p in stage.parameters()])}


@pytest.mark.parametrize("how", ["hook", "argument"])
@pytest.mark.slow
def test_subspace_gpt_pipeline_sends_k_over_d_of_the_bytes_and_equals_the_plain_pipeline(tmp_path, how):
    """A 2 x 2 Lightning pipeline of ``GPT(subspace_rank=K)`` built for its 2 stages, its activation codec from
    the module's ``configure_activation_codec`` (or the strategy's ``activation_codec=activation_codec_for``):
    every step's boundary carries exactly K/d of the plain split's bytes (measured by the pipelines, both
    directions), and its losses and final weights are those of the plain ``Pipeline`` loop with the same codec.
    48 samples / (2 replicas x 8) = 3 steps per epoch, 2 epochs, a round every 2 steps. The "argument" run's GPT
    has stage embeddings (every stage re-embeds the token ids, which the codec hands to the stage module)."""
    extra = ("--codec-arg", "--stage-embeddings") if how == "argument" else ()
    ranks = _launch(tmp_path / "lightning", "--stages", "2", "--microbatches", "2", "--gpt", str(K), "--samples",
                    "48", "--max-epochs", "2", "--topology", "allreduce", "--sync-every", "2", *extra, devices=4)
    reference = run_ranks(_gpt_pipeline_reference, 4, tmp_path, 48, 8, 2, 2, how == "argument")
    d = 32
    for rank, (got, want) in enumerate(zip(ranks, reference)):
        replica, stage = divmod(rank, 2)
        assert (got["replica"], got["stage"]) == (replica, stage) and got["codec_needs_inputs"] is True
        assert got["global_step"] == 6 and got["rounds"] == 3 and len(got["step_bytes"]) == 6
        fwd, bwd = want["plain_sent"]  # the plain split: x forward from stage 0, ∂L/∂x back from stage 1
        assert (fwd, bwd) == ((8 * 16 * d * 4, 0) if stage == 0 else (0, 8 * 16 * d * 4))
        assert got["step_bytes"] == [(fwd * K // d, bwd * K // d)] * 6 == want["sent"]
        torch.testing.assert_close(got["final_params"], want["final_params"], rtol=1e-5, atol=1e-6)
    for replica in range(2):  # the replica's loss, broadcast to both its stages, is the plain pipeline's
        want = reference[2 * replica + 1]["losses"]
        for stage in range(2):
            assert ranks[2 * replica + stage]["step_losses"] == pytest.approx(want, rel=1e-5)
    assert ranks[1]["step_losses"] != ranks[3]["step_losses"]  # the replicas read different shards


def test_activation_codec_argument_and_hook():
    from fgdiloco.pipeline.subspace import SubspaceActivationCodec
    from fgdiloco.pretrain import activation_codec_for
    from tests.lightning_scripts.train import make_gpt_stage

    with pytest.raises(TypeError, match="activation_codec must be None, an activation codec or a callable"):
        FGDiLoCoStrategy(pipeline_stages=2, activation_codec="subspace")
    stage = make_gpt_stage(K, 0, 2, 0)
    codec = activation_codec_for(stage)

    class Plain(pl.LightningModule):
        pass

    class Hooked(pl.LightningModule):
        def configure_activation_codec(self, stage: int, stages: int):
            self.called = (stage, stages)
            return codec

    for given, module, want in ((activation_codec_for, Plain(), SubspaceActivationCodec), (codec, Plain(), codec),
                                (None, Plain(), None), (None, Hooked(), codec)):
        strategy = FGDiLoCoStrategy(pipeline_stages=2, activation_codec=given)
        strategy._lightning_module = module  # what setup() sets
        got = strategy._stage_activation_codec(stage)
        assert (isinstance(got, want) if isinstance(want, type) else got is want), given
    assert module.called == (0, 2)
    strategy = FGDiLoCoStrategy(pipeline_stages=2, activation_codec=codec)
    strategy._lightning_module = Hooked()
    with pytest.raises(ValueError, match="configure_activation_codec and the strategy's activation_codec= both"):
        strategy._stage_activation_codec(stage)
    strategy = FGDiLoCoStrategy(pipeline_stages=2, activation_codec=lambda stage_module: "not a codec")
    strategy._lightning_module = Plain()
    with pytest.raises(TypeError, match=r"activation_codec\(GPTStage\) must return None or an activation codec"):
        strategy._stage_activation_codec(stage)

"""Subspace compression in the pipeline (Ramasinghe et al., arXiv 2506.01260): a ``GPT(subspace_rank=k)`` split
into stages whose boundaries carry c (k numbers per token) forward and ∂L/∂c back, on real Gloo ranks.

The contract: the compressed 2-stage pipeline's loss and gradients equal the unsplit reparametrised model's (both
schedules), exactly k·tokens·4 bytes cross each direction (measured by the pipeline), U and E_fix never change,
are never parameters and are not in FGDiLoCo's synchronised set, and a module writing outside the subspace is
caught at the boundary with a SubspaceError.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fgdiloco import FGDiLoCo, ReplicaMesh
from fgdiloco.pipeline import Pipeline
from fgdiloco.pipeline.codec import _inferring_shapes, shape_inference
from fgdiloco.pipeline.subspace import (
    SubspaceActivationCodec,
    SubspaceError,
    fixed_embedding,
    orthonormal_basis,
)
from fgdiloco.pretrain.model import GPT, GPTConfig, GPTStage, activation_codec_for, build_stage, lm_loss
from fgdiloco.testing import run_ranks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
CFG3 = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16)  # for 3 stages
K = 4  # d / 4
SEED = 3  # of U and E_fix
M = 4  # microbatches
B, T = 8, 16


def subspace_gpt(k: int = K, cfg: GPTConfig = CFG, stages: int | None = None) -> GPT:
    """A subspace GPT with every trainable parameter moved off its initialisation (Z_tok starts at zero); built
    for ``stages`` (only the writes that cross a boundary constrained) or, None, with every block constrained."""
    torch.manual_seed(0)
    model = GPT(cfg, subspace_rank=k, subspace_seed=SEED, subspace_stages=stages)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def lm_batch(step: int = 0, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, CFG.vocab_size, (batch, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def stage_to_model_name(stage: GPTStage, name: str) -> str:
    """The name of a stage's parameter in the unsplit GPT (the head's weight is the tied embedding's)."""
    if name.startswith("h."):
        _, j, rest = name.split(".", 2)
        return f"transformer.h.{stage.layers[int(j)]}.{rest}"
    if name.startswith("lm_head."):
        return "transformer.wte.weight"
    return f"transformer.{name}"


# ------------------------------------------------------------------ loss and gradients equal the unsplit model's
def _pipe_grads(rank: int, world: int, schedule: str, k: int, head: str, built: int | None) -> dict:
    mesh = ReplicaMesh(1, world)
    stage = subspace_gpt(k, CFG if world == 2 else CFG3, built).split(world, subspace_head=head)[mesh.stage]
    pipe = Pipeline(stage, mesh, lm_loss, M, schedule, activation_codec=activation_codec_for(stage))
    idx, y = lm_batch()
    loss = pipe.step(idx, y)  # the token ids on every stage
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stats = pipe.last_step.as_dict()
    held_out = pipe.eval_loss(*lm_batch(7))
    return {"loss": loss, "grads": grads, "stats": stats, "eval": held_out}


@pytest.mark.parametrize(("schedule", "k", "S", "head", "built"), [
    ("1f1b", K, 2, "dense", None), ("gpipe", K, 2, "dense", None), ("1f1b", 1, 2, "dense", None),
    ("1f1b", K, 3, "dense", None), ("gpipe", K, 2, "subspace", None),
    # built for the split: the last stage's blocks write freely, the boundaries stay lossless
    ("1f1b", K, 2, "dense", 2), ("gpipe", 1, 3, "dense", 3),
])
def test_compressed_pipeline_equals_the_unsplit_reparametrised_model(tmp_path, schedule, k, S, head, built):
    res = run_ranks(_pipe_grads, S, tmp_path, schedule, k, head, built)
    model = subspace_gpt(k, CFG if S == 2 else CFG3, built)
    if built is not None:  # the last stage's blocks are plain
        assert model.subspace_layers == range(model.config.n_layer - 1)
        assert type(model.transformer.h[-1].mlp.c_proj) is nn.Linear
    stages = model.split(S, subspace_head=head)
    idx, y = lm_batch()
    _, want_loss = model(idx, y)
    want_loss.backward()
    want = {n: p.grad for n, p in model.named_parameters()}  # the tied Z_tok: embedding + head gradients
    head_grad = res[-1]["grads"].pop("lm_head.weight")
    if head == "dense":  # the untied head's W = E_fix + Z_tok Uᵀ at split time: ∂L/∂Z_tok = ∂L/∂W · U
        assert head_grad.shape == (CFG.vocab_size, CFG.n_embd)
        head_grad = head_grad @ model.transformer.wte.U
    torch.testing.assert_close(res[0]["grads"]["wte.weight"] + head_grad, want["transformer.wte.weight"],
                               rtol=1e-5, atol=1e-6)
    seen = {"transformer.wte.weight"}
    for s, r in zip(stages, res):
        for name, g in r["grads"].items():
            if name == "wte.weight":
                continue
            key = stage_to_model_name(s, name)
            torch.testing.assert_close(g, want[key], rtol=1e-5, atol=1e-6, msg=key)
            seen.add(key)
    assert seen == set(want)  # every parameter of the model is on exactly one stage
    assert all(r["loss"] is None and r["eval"] is None for r in res[:-1])
    torch.testing.assert_close(res[-1]["loss"], want_loss.detach(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(res[-1]["eval"], model(*lm_batch(7))[1], rtol=1e-6, atol=1e-6)

    # bytes measured by the pipeline: exactly k fp32 numbers per token and direction, nothing else
    stats = [r["stats"] for r in res]
    per_direction = k * B * T * 4
    for s, st in enumerate(stats):  # forward to the next stage (all but the last), backward to the previous
        assert st["forward_bytes_sent"] == (per_direction if s < S - 1 else 0)
        assert st["backward_bytes_sent"] == (per_direction if s > 0 else 0)
        assert st["bytes_received"] == per_direction * (2 if 0 < s < S - 1 else 1)
    assert per_direction * CFG.n_embd // k == B * T * CFG.n_embd * 4  # d/k fewer than the dense stream
    assert activation_codec_for(stages[0]).wire_bytes(B, T).forward == per_direction


# ------------------------------------------------------------------ U / E_fix: fixed, not parameters, not gossiped
def _train_2x2(rank: int, world: int) -> dict:
    mesh = ReplicaMesh(2, 2, timeout=20.0)
    stage = build_stage(CFG, 2, mesh.stage, subspace_rank=K, subspace_seed=SEED, seed=0)
    pipe = Pipeline(stage, mesh, lm_loss, 2, "1f1b", activation_codec=activation_codec_for(stage))
    opt = FGDiLoCo(stage, torch.optim.AdamW(stage.parameters(), lr=1e-2), sync_every=2, topology="allreduce",
                   codec="dense", mesh=mesh, timeout=20.0)
    synced = {t.data_ptr() for t in opt.params}
    fixed = [t for n, t in stage.named_buffers(remove_duplicate=False) if n.split(".")[-1] in ("U", "E_fix")]
    activation_bytes = []
    for step in range(4):  # two rounds
        pipe.step(*lm_batch(10 * mesh.replica + step, batch=4))
        opt.step()
        opt.zero_grad()
        activation_bytes.append(pipe.last_step.activation_bytes_sent)
    opt.close()
    return {
        "stage": mesh.stage, "U": stage.U.clone(), "E_fix": stage.E_fix.clone(),
        # stage 0's modules share the stage's U / E_fix; the last stage keeps them for its boundary (its blocks
        # are plain: built for 2 stages, only what crosses is constrained)
        "fixed_are_shared": all(t is stage.U or t is stage.E_fix for t in fixed) and len(fixed) > 2 - mesh.stage,
        "plain_blocks": all(type(b.mlp.c_proj) is nn.Linear for b in stage.h),
        "fixed_in_synced": any(t.data_ptr() in synced for t in fixed),
        "synced_numel": sum(t.numel() for t in opt.params),
        "param_numel": sum(p.numel() for p in stage.parameters()),
        "param_names": [n for n, _ in stage.named_parameters()],
        "activation_bytes": activation_bytes,
        "params": {n: p.detach().clone() for n, p in stage.named_parameters()},
    }


def test_u_and_e_fix_never_change_and_are_neither_parameters_nor_synchronised(tmp_path):
    res = run_ranks(_train_2x2, 4, tmp_path, timeout=240)
    U = orthonormal_basis(CFG.n_embd, K, SEED)
    E_fix = fixed_embedding(CFG.vocab_size, CFG.n_embd, SEED)
    for r in res:
        assert torch.equal(r["U"], U) and torch.equal(r["E_fix"], E_fix)  # bit for bit, after training
        assert r["plain_blocks"] == (r["stage"] == 1)
        assert r["fixed_are_shared"]  # one U / E_fix per stage, shared by its modules
        assert not r["fixed_in_synced"]
        assert r["synced_numel"] == r["param_numel"]
        assert not any(n.split(".")[-1] in ("U", "E_fix") for n in r["param_names"])
    # stage 0 sends k numbers per token forward, stage 1 sends k back: nothing else crosses the boundary
    for r in res:
        assert r["activation_bytes"] == [K * 4 * T * 4] * 4
    # the exact topology: the two replicas of each stage agree after the last round, and they trained
    for s in (0, 1):
        a, b = (r["params"] for r in res if r["stage"] == s)
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=0, atol=1e-6)
    start = build_stage(CFG, 2, 0, subspace_rank=K, subspace_seed=SEED, seed=0)
    assert not torch.equal(next(r for r in res if r["stage"] == 0)["params"]["wte.weight"], start.wte.weight)


# ------------------------------------------------------------------ a module writing outside the subspace
def _outside(rank: int, world: int) -> dict:
    mesh = ReplicaMesh(1, 2, timeout=3.0)
    stage = subspace_gpt().split(2)[mesh.stage]
    if mesh.stage == 0:  # a user's module: a plain projection writes into all d directions
        torch.manual_seed(5)
        stage.h[0].mlp.c_proj = nn.Linear(4 * CFG.n_embd, CFG.n_embd)
    pipe = Pipeline(stage, mesh, lm_loss, 2, "gpipe", activation_codec=activation_codec_for(stage))
    try:
        pipe.step(*lm_batch())
    except Exception as e:  # noqa: BLE001 - returned to the test
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None}


def test_a_module_writing_outside_the_subspace_is_caught_at_the_boundary(tmp_path):
    first, last = run_ranks(_outside, 2, tmp_path, timeout=60)
    assert first["type"] == "SubspaceError"
    assert "at boundary_out" in first["msg"] and "outside E_fix[tokens] + span(U)" in first["msg"]
    assert last["type"] == "PipelineError"  # its neighbour stopped


def _inputs_everywhere(rank: int, world: int) -> str:
    mesh = ReplicaMesh(1, 2)
    stage = subspace_gpt().split(2)[mesh.stage]
    pipe = Pipeline(stage, mesh, lm_loss, 2, "gpipe", activation_codec=activation_codec_for(stage))
    try:
        pipe.step(None, lm_batch()[1])
    except ValueError as e:
        return str(e)
    return "no error"


def test_every_stage_needs_the_token_ids(tmp_path):
    first, last = run_ranks(_inputs_everywhere, 2, tmp_path, timeout=60)
    assert first == "inputs are required on the first stage"
    assert last.startswith("inputs are required on every stage: the activation codec reads them")


# ------------------------------------------------------------------ split, build_stage, the codec (one process)
def test_subspace_split_chains_to_the_models_logits_with_a_basis_per_stage():
    model = subspace_gpt()
    idx, _ = lm_batch()
    for S in (1, 2):
        stages = model.split(S)
        x = idx
        for s in stages:
            x = s(x)
        # exact for S = 1; the dense head of S = 2 computes E_fix + Z_tok Uᵀ once, in another order: rounding
        torch.testing.assert_close(x, model(idx)[0], rtol=0, atol=0 if S == 1 else 1e-6)
    before = torch.get_rng_state()
    s0, s1 = model.split(2)
    assert torch.equal(torch.get_rng_state(), before)  # splitting draws no random numbers
    for s in (s0, s1):
        assert s.subspace_rank == K and s.subspace_seed == SEED
        assert torch.equal(s.U, model.transformer.wte.U) and torch.equal(s.E_fix, model.transformer.wte.E_fix)
        assert s.U is not model.transformer.wte.U  # the stage's own copy
        for m in s.modules():
            if "U" in m._buffers:
                assert m.U is s.U
            if "E_fix" in m._buffers:
                assert m.E_fix is s.E_fix
    assert s0.U is not s1.U
    # S > 1: the head is untied; by default a dense vocab x d map that starts as E_fix + Z_tok Uᵀ
    wte = model.transformer.wte
    assert isinstance(s1.lm_head, nn.Linear) and s1.lm_head.weight.shape == (CFG.vocab_size, CFG.n_embd)
    torch.testing.assert_close(s1.lm_head.weight, wte.E_fix + wte.weight @ wte.U.T, rtol=0, atol=0)
    # ... or, subspace_head="subspace", the tied form's constraint with its own copy of Z_tok
    c1 = model.split(2, subspace_head="subspace")[1]
    assert c1.lm_head.weight is not wte.weight and torch.equal(c1.lm_head.weight, wte.weight)
    assert c1.lm_head.E_fix is c1.E_fix and c1.lm_head.U is c1.U
    x = idx
    for s in model.split(2, subspace_head="subspace"):
        x = s(x)
    torch.testing.assert_close(x, model(idx)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"subspace_head must be one of \('dense', 'subspace'\), got 'tied'"):
        model.split(2, subspace_head="tied")
    (one,) = model.split(1)
    assert one.lm_head.weight is one.wte.weight and one.lm_head.E_fix is one.wte.E_fix is one.E_fix
    # the boundary stream of stage 0 is in the subspace: compress / decompress is exact
    codec = s0.subspace_codec()
    x = s0(idx)
    torch.testing.assert_close(codec.decompress(*codec.compress(x, idx)), x, rtol=0, atol=1e-6)


def test_build_stage_is_the_seeded_models_stage_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    stage = build_stage(CFG, 2, 1, subspace_rank=K, subspace_seed=SEED, seed=4)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(4)
    want = GPT(CFG, subspace_rank=K, subspace_seed=SEED, subspace_stages=2).split(2)[1]
    assert stage.state_dict().keys() == want.state_dict().keys()
    for key, value in want.state_dict().items():
        assert torch.equal(stage.state_dict()[key], value), key
    assert stage.subspace_stages == 2 and stage.subspace_layers == range(1)  # built for its split
    assert all(type(b.attn.c_proj) is nn.Linear for b in stage.h)  # the last stage writes freely
    whole = build_stage(CFG, 1, 0, subspace_rank=K, seed=4)  # one stage: every block constrained
    assert whole.subspace_stages is None and whole.subspace_layers == range(2)
    plain = build_stage(CFG, 2, 0, seed=4)
    assert plain.subspace_rank is None and "U" not in dict(plain.named_buffers())
    assert activation_codec_for(plain) is None
    assert activation_codec_for(GPT(CFG)) is None
    assert isinstance(activation_codec_for(GPT(CFG, subspace_rank=2)), SubspaceActivationCodec)
    assert GPT(CFG, subspace_rank=2).activation_codec().k == 2 and GPT(CFG).activation_codec() is None
    with pytest.raises(RuntimeError, match="without subspace_rank"):
        plain.subspace_codec()


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"stages": 3}, ValueError, r"stages must be an int in \[1, n_layer=2\], got 3"),
    ({"stages": 0}, ValueError, r"stages must be an int in \[1, n_layer=2\], got 0"),
    ({"stages": 2.0}, TypeError, "stages must be an int, got float"),
    ({"stage": 2}, ValueError, r"stage must be an int in \[0, stages=2\), got 2"),
    ({"stage": -1}, ValueError, "stage must be an int >= 0, got -1"),
    ({"seed": None}, TypeError, "seed must be an int, got NoneType"),
    ({"subspace_rank": 17}, ValueError, r"subspace_rank must be None or an int in \[1, n_embd=16\]"),
    ({"config": {"vocab_size": 64}}, TypeError, "config must be a GPTConfig, got dict"),
    ({"subspace_head": "full"}, ValueError, r"subspace_head must be one of \('dense', 'subspace'\)"),
])
def test_build_stage_bad_arguments(kwargs, exc, match):
    args = {"config": CFG, "stages": 2, "stage": 0, **kwargs}
    with pytest.raises(exc, match=match):
        build_stage(args.pop("config"), args.pop("stages"), args.pop("stage"), **args)


def test_activation_codec_checks_except_during_shape_inference():
    model = subspace_gpt()
    codec = activation_codec_for(model)
    assert codec.needs_inputs and codec.k == K and codec.d == CFG.n_embd
    idx, _ = lm_batch()
    x = model.split(2)[0](idx)
    outside = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    with pytest.raises(SubspaceError, match="at boundary_out"):
        codec.encode(outside, inputs=idx)
    assert not shape_inference()
    with _inferring_shapes():  # the pipeline infers shapes on uninitialised tensors: no value check
        assert shape_inference()
        c = codec.encode(torch.full_like(x, float("nan")), inputs=idx)
    assert not shape_inference() and c.shape == (B, T, K)
    c = codec.encode(x.requires_grad_(), inputs=(idx,))  # inputs as the pipeline's tuple
    torch.testing.assert_close(codec.decode(c, inputs=idx), x, rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="needs the microbatch's token ids"):
        codec.decode(c)
    with pytest.raises(TypeError, match="model must be a GPT or a GPTStage, got Linear"):
        activation_codec_for(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="codec must be a SubspaceCodec, got str"):
        SubspaceActivationCodec("codec")
    wte = model.transformer.wte
    same = SubspaceActivationCodec.from_basis(wte.U, wte.E_fix, check=False)
    assert not same.codec.check
    with torch.no_grad():  # unchecked: the projection of the stream, whatever it is
        torch.testing.assert_close(same.encode(outside, inputs=idx), (outside - wte.E_fix[idx]) @ wte.U,
                                   rtol=0, atol=1e-6)


# ------------------------------------------------------------------ stage embeddings: every stage re-embeds the ids
def _stage_embedding_pipe(rank: int, world: int, k: int) -> dict:
    mesh = ReplicaMesh(1, world)
    stage = build_stage(CFG3 if world == 3 else CFG, world, mesh.stage, subspace_rank=k, subspace_seed=SEED, seed=5,
                        stage_embeddings=True)
    pipe = Pipeline(stage, mesh, lm_loss, M, "1f1b", activation_codec=activation_codec_for(stage))
    idx, y = lm_batch()
    loss = pipe.step(idx, y)
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in stage.named_parameters()},
            "stats": pipe.last_step.as_dict()}


@pytest.mark.parametrize(("S", "k"), [(2, K), (3, 1)])
def test_stage_embeddings_pipeline_equals_the_unsplit_model_and_sends_k_numbers_per_token(tmp_path, S, k):
    res = run_ranks(_stage_embedding_pipe, S, tmp_path, k)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = GPT(CFG3 if S == 3 else CFG, subspace_rank=k, subspace_seed=SEED, subspace_stages=S,
                    stage_embeddings=True)
    assert len(model.stage_embeddings) == S
    idx, y = lm_batch()
    _, want_loss = model(idx, y)
    want_loss.backward()
    torch.testing.assert_close(res[-1]["loss"], want_loss.detach(), rtol=1e-6, atol=1e-6)
    for s, r in enumerate(res):  # every stage's own embedding gets the gradient of the unsplit model's
        for part in ("wte", "wpe"):
            torch.testing.assert_close(r["grads"][f"stage_embedding.{part}.weight"],
                                       model.stage_embeddings[s].get_submodule(part).weight.grad, rtol=1e-5,
                                       atol=1e-6)
    for s, r in enumerate(res):  # still k numbers per token and direction cross each boundary
        assert r["stats"]["forward_bytes_sent"] == (k * B * T * 4 if s < S - 1 else 0)
        assert r["stats"]["backward_bytes_sent"] == (k * B * T * 4 if s > 0 else 0)

"""Subspace compression of the activations between pipeline stages (Ramasinghe et al., arXiv 2506.01260).

The seeded basis, the activation codec and its autograd boundary pair, and the example GPT reparametrised so that
its residual stream stays in E_fix[tokens] + span(U).
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fgdiloco import FGDiLoCo
from fgdiloco.pipeline.subspace import (
    BoundaryIn,
    BoundaryOut,
    SubspaceBasis,
    SubspaceCodec,
    SubspaceError,
    default_tolerance,
    fixed_embedding,
    orthonormal_basis,
    orthonormalize,
)
from fgdiloco.pretrain.model import GPT, GPTConfig, SubspaceLinear, stage_layers
from fgdiloco.testing import run_ranks

FIXTURES = Path(__file__).parent / "fixtures"


# ------------------------------------------------------------------------------------------------ plain GPT pinned
def _plain_forward(fixture: dict) -> dict:
    torch.manual_seed(fixture["seed"])
    model = GPT(GPTConfig(**fixture["config"]))
    idx, tgt = torch.tensor(fixture["idx"]), torch.tensor(fixture["targets"])
    logits, loss = model(idx, tgt)
    loss.backward()
    params = list(model.parameters())
    return dict(
        param_sum=float(sum(p.detach().double().sum() for p in params)),
        param_sq=float(sum((p.detach().double() ** 2).sum() for p in params)),
        num_parameters=model.num_parameters(),
        loss=float(loss.detach()),
        logits_head=logits[0, :3, :6].tolist(),
        logits_sq=float((logits.detach().double() ** 2).sum()),
        grad_norm=float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))),
    )


def test_plain_gpt_is_unchanged_against_pinned_fixture():
    """The pinned numbers were produced by the GPT before the subspace option existed (``subspace_rank=None``):
    initialisation (which consumes the global RNG in a fixed order), forward, loss and gradient must not move."""
    fixture = json.loads((FIXTURES / "gpt_forward.json").read_text())
    got = _plain_forward(fixture)
    assert got["num_parameters"] == fixture["num_parameters"]
    for key in ("param_sum", "param_sq", "loss", "logits_sq", "grad_norm"):
        assert got[key] == pytest.approx(fixture[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(torch.tensor(got["logits_head"]), torch.tensor(fixture["logits_head"]),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ basis
@pytest.mark.parametrize("d,k", [(1, 1), (16, 1), (16, 4), (64, 8), (128, 128)])
def test_basis_has_orthonormal_columns_and_is_a_function_of_d_k_seed(d, k):
    rng = torch.get_rng_state()
    b = SubspaceBasis(d, k, seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is neither read nor advanced
    assert b.U.shape == (d, k) and b.U.dtype == torch.float32 and (b.d, b.k, b.seed) == (d, k, 7)
    torch.testing.assert_close(b.U.T @ b.U, torch.eye(k), rtol=0, atol=1e-6)
    u64 = orthonormal_basis(d, k, 7, dtype=torch.float64)
    torch.testing.assert_close(u64.T @ u64, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-13)
    assert torch.equal(u64.float(), b.U)  # the float32 basis is the float64 one rounded
    assert torch.equal(SubspaceBasis(d, k, seed=7).U, b.U)
    assert b.fingerprint() == SubspaceBasis(d, k, seed=7).fingerprint()
    if d > 1:
        other = SubspaceBasis(d, k, seed=8)
        assert not torch.equal(other.U, b.U) and other.fingerprint() != b.fingerprint()
    half = b.to(dtype=torch.bfloat16)
    assert half.U.dtype == torch.bfloat16 and b.U.dtype == torch.float32 and half.fingerprint() != b.fingerprint()


def test_orthonormalize_is_unique_up_to_the_span():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 5, generator=g, dtype=torch.float64)
    q = orthonormalize(a)
    torch.testing.assert_close(q.T @ q, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-13)
    assert (torch.diagonal(q.T @ a) > 0).all()  # diag(R) > 0: the sign convention
    # any a·R with R upper triangular and a positive diagonal spans the same nested subspaces: the same Q
    r = torch.triu(torch.rand(5, 5, generator=g, dtype=torch.float64)) + torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(orthonormalize(a @ r), q, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="m >= n"):
        orthonormalize(torch.randn(3, 4))


_CHILD = """
import hashlib, sys, torch
from fgdiloco.pipeline.subspace import SubspaceBasis, fixed_embedding
torch.manual_seed(int(sys.argv[1]))  # the global seed must not matter
b = SubspaceBasis(96, 12, seed=5)
e = fixed_embedding(300, 96, seed=5)
print(b.fingerprint(), hashlib.sha256(e.numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_basis_and_fixed_embedding_are_identical_in_fresh_processes():
    outs = [subprocess.run([sys.executable, "-c", _CHILD, str(s)], capture_output=True, text=True, check=True,
                           timeout=120).stdout.split() for s in (1, 2)]
    here = [SubspaceBasis(96, 12, seed=5).fingerprint(),
            hashlib.sha256(fixed_embedding(300, 96, seed=5).numpy().tobytes()).hexdigest()]
    assert outs[0] == outs[1] == here


def test_fixed_embedding_is_seeded_and_scaled():
    e = fixed_embedding(2000, 64, seed=3, std=0.02)
    assert e.shape == (2000, 64) and e.dtype == torch.float32
    assert float(e.std()) == pytest.approx(0.02, rel=0.02) and abs(float(e.mean())) < 1e-3
    assert torch.equal(e, fixed_embedding(2000, 64, seed=3))
    assert not torch.equal(e, fixed_embedding(2000, 64, seed=4))
    # its stream is not the basis's stream for the same seed
    assert not torch.allclose(orthonormal_basis(64, 64, 3), e[:64] / e[:64].norm(dim=0))


@pytest.mark.parametrize("args,exc,match", [
    ((0, 1), ValueError, r"d must be an int >= 1"),
    ((4, 0), ValueError, r"k must be an int in \[1, 4\]"),
    ((4, 5), ValueError, r"k must be an int in \[1, 4\].*at most d = 4"),
    ((4.0, 2), TypeError, r"d must be an int"),
    ((4, True), TypeError, r"k must be an int"),
    ((4, 2, -1), ValueError, r"seed must be an int in \[0, "),
    ((4, 2, 1.5), TypeError, r"seed must be an int"),
])
def test_basis_bad_arguments_name_the_argument(args, exc, match):
    with pytest.raises(exc, match=match):
        SubspaceBasis(*args)


def test_basis_bad_dtype_and_from_tensor():
    with pytest.raises(TypeError, match="dtype must be a floating"):
        SubspaceBasis(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"U must be a floating \[d, k\]"):
        SubspaceBasis.from_tensor(torch.zeros(2, 3))
    u = orthonormal_basis(8, 3, 1)
    b = SubspaceBasis.from_tensor(u, seed=1)
    assert b.U is u and (b.d, b.k) == (8, 3)


# ------------------------------------------------------------------------------------------------ codec
def _codec(d=32, k=8, vocab=50, seed=0, **kw) -> SubspaceCodec:
    return SubspaceCodec(SubspaceBasis(d, k, seed), fixed_embedding(vocab, d, seed), **kw)


def _in_subspace(codec: SubspaceCodec, shape=(3, 7), seed=0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, codec.vocab_size, shape, generator=g)
    c = torch.randn(*shape, codec.k, generator=g)
    return codec.token_embedding[tokens] + c @ codec.basis.U.T, tokens, c


def test_codec_is_exact_in_the_subspace():
    codec = _codec()
    x, tokens, c = _in_subspace(codec)
    got, same_tokens = codec.compress(x, tokens)
    assert got.shape == (3, 7, 8) and got.dtype == x.dtype and same_tokens is tokens
    torch.testing.assert_close(got, c, rtol=0, atol=2e-6)
    torch.testing.assert_close(codec.decompress(got, tokens), x, rtol=0, atol=2e-6)
    res = codec.residual(x, tokens)
    assert res.max_relative < 1e-6 and res.relative <= res.max_relative and res.norm < 1e-5
    # float64 end to end: exact to float64 rounding
    c64 = SubspaceCodec(SubspaceBasis(32, 8, 0, dtype=torch.float64), fixed_embedding(50, 32, 0, dtype=torch.float64))
    x64 = c64.decompress(c.double(), tokens)
    torch.testing.assert_close(c64.compress(x64, tokens)[0], c.double(), rtol=0, atol=1e-13)
    assert c64.residual(x64, tokens).max_relative < 1e-14


@settings(max_examples=60, deadline=None)
@given(d=st.integers(1, 48), frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**40), batch=st.integers(1, 4),
       seq=st.integers(1, 6), scale=st.floats(1e-3, 1e3))
def test_compress_decompress_properties(d, frac, seed, batch, seq, scale):
    k = max(1, round(frac * d))
    codec = _codec(d, k, vocab=11, seed=seed % 1000, check=False)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (batch, seq), generator=g)
    c = torch.randn(batch, seq, k, generator=g, dtype=torch.float64).float() * scale
    x = codec.decompress(c, tokens)
    atol = 1e-5 * (scale * math.sqrt(k) + 0.02 * math.sqrt(d))
    # compress ∘ decompress = identity on coefficients; decompress ∘ compress = identity on the subspace
    torch.testing.assert_close(codec.compress(x, tokens)[0], c, rtol=0, atol=atol)
    assert codec.residual(x, tokens).max_relative < default_tolerance(torch.float32)
    # any x: decompress ∘ compress is the orthogonal projection onto E_fix[tokens] + span(U): idempotent, and
    # what it drops is orthogonal to U and is exactly the residual
    y = torch.randn(batch, seq, d, generator=g) * scale
    p = codec.decompress(*codec.compress(y, tokens))
    torch.testing.assert_close(codec.decompress(*codec.compress(p, tokens)), p, rtol=0, atol=atol)
    dropped = (y - p).double()
    assert float((dropped @ codec.basis.U.double()).abs().max()) <= atol
    assert codec.residual(y, tokens).norm == pytest.approx(float(dropped.norm()), rel=1e-3, abs=atol)


def test_check_catches_a_stream_outside_the_subspace():
    codec = _codec()
    x, tokens, _ = _in_subspace(codec)
    outside = torch.zeros(32)
    outside[0] = 1.0
    outside -= codec.basis.U @ (codec.basis.U.T @ outside)  # a direction orthogonal to span(U)
    bad = x.clone()
    bad[1, 3] += 0.01 * x[1, 3].norm() * outside / outside.norm()  # one token, 1 % of its norm
    res = codec.residual(bad, tokens)
    assert res.max_relative == pytest.approx(0.01, rel=1e-3)
    assert res.relative < res.max_relative  # the per-token maximum is not averaged away
    with pytest.raises(SubspaceError, match=r"outside E_fix\[tokens\] \+ span\(U\).*0\.01.*tolerance 0\.0001"):
        codec.compress(bad, tokens)
    with pytest.raises(SubspaceError, match="at boundary_out"):
        codec.boundary_out(bad, tokens)
    assert codec.verify(x, tokens).max_relative < 1e-6
    _codec(check=False).compress(bad, tokens)  # check off: no error, the projection is sent
    _codec(tol=0.02).compress(bad, tokens)  # a looser tolerance accepts it
    nan = x.clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(SubspaceError):
        codec.compress(nan, tokens)


def test_codec_bad_inputs_raise_before_anything():
    codec = _codec()
    x, tokens, c = _in_subspace(codec)
    with pytest.raises(ValueError, match=r"x must be a floating \[\.\.\., d=32\]"):
        codec.compress(x[..., :-1], tokens)
    with pytest.raises(ValueError, match=r"tokens must have the leading shape of x, \(3, 7\)"):
        codec.compress(x, tokens[:, :-1])
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        codec.compress(x, tokens.float())
    with pytest.raises(ValueError, match=r"c must be a floating \[\.\.\., k=8\]"):
        codec.decompress(x, tokens)
    with pytest.raises(ValueError, match=r"token_embedding must be a floating \[vocab, d=32\]"):
        SubspaceCodec(SubspaceBasis(32, 8), torch.zeros(5, 31))
    with pytest.raises(TypeError, match="basis must be a SubspaceBasis"):
        SubspaceCodec("U", torch.zeros(5, 32))
    with pytest.raises(ValueError, match=r"basis must have orthonormal columns .*max \|UᵀU − I\| is 3"):
        SubspaceCodec(2 * orthonormal_basis(32, 8), torch.zeros(5, 32))
    SubspaceCodec(orthonormal_basis(32, 8, dtype=torch.bfloat16), torch.zeros(5, 32))  # bf16 rounding is fine
    with pytest.raises(ValueError, match="tol must be a finite number > 0"):
        _codec(tol=0.0)
    with pytest.raises(TypeError, match="codec must be a SubspaceCodec"):
        BoundaryOut("codec")


def test_wire_bytes_count_both_directions_and_optional_token_ids():
    codec = _codec(d=128, k=16, vocab=2048)
    w = codec.wire_bytes(16, 128)  # fp32, ids do not travel
    n = 16 * 128
    assert (w.forward, w.backward, w.tokens) == (n * 16 * 4, n * 16 * 4, 0)
    assert (w.dense_forward, w.dense_backward) == (n * 128 * 4, n * 128 * 4)
    assert w.total == 2 * n * 16 * 4 and w.ratio == 8.0
    bf = codec.wire_bytes(16, 128, torch.bfloat16)
    assert bf.forward == n * 16 * 2 and bf.dense_total == n * 128 * 2 * 2 and bf.ratio == 8.0
    ids = codec.wire_bytes(16, 128, token_dtype=torch.int32)
    assert ids.tokens == n * 4 and ids.total == w.total + n * 4
    assert ids.ratio == pytest.approx(2 * 128 * 4 / (2 * 16 * 4 + 4))
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        codec.wire_bytes(0, 128)
    with pytest.raises(TypeError, match="dtype must be a floating"):
        codec.wire_bytes(1, 1, torch.int8)
    with pytest.raises(TypeError, match="token_dtype must be an integer"):
        codec.wire_bytes(1, 1, token_dtype=torch.float32)


def test_boundary_pair_gradients_are_k_dimensional_and_exact():
    codec = _codec(check=False)
    U = codec.basis.U
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (2, 5), generator=g)
    x = torch.randn(2, 5, 32, generator=g, requires_grad=True)
    c = codec.boundary_out(x, tokens)
    assert c.shape == (2, 5, 8)
    torch.testing.assert_close(c, (x - codec.token_embedding[tokens]) @ U)
    grad_c = torch.randn(2, 5, 8, generator=g)
    c.backward(grad_c)
    torch.testing.assert_close(x.grad, grad_c @ U.T, rtol=0, atol=0)
    received = c.detach().requires_grad_()
    xr = codec.boundary_in(received, tokens)
    grad_x = torch.randn(2, 5, 32, generator=g)
    xr.backward(grad_x)
    assert received.grad.shape == (2, 5, 8)  # what goes back: k numbers per token
    torch.testing.assert_close(received.grad, grad_x @ U, rtol=0, atol=0)
    # float64 gradcheck of both Functions against finite differences
    c64 = SubspaceCodec(SubspaceBasis(6, 2, 1, dtype=torch.float64), fixed_embedding(4, 6, 1, dtype=torch.float64),
                        check=False)
    t = torch.tensor([[0, 3, 1]])
    torch.autograd.gradcheck(lambda v: c64.boundary_out(v, t), torch.randn(1, 3, 6, dtype=torch.float64,
                                                                             requires_grad=True))
    torch.autograd.gradcheck(lambda v: c64.boundary_in(v, t), torch.randn(1, 3, 2, dtype=torch.float64,
                                                                            requires_grad=True))
    out, inn = BoundaryOut(codec), BoundaryIn(codec)
    torch.testing.assert_close(inn(out(xr.detach(), tokens), tokens), xr.detach(), rtol=0, atol=2e-6)


# ------------------------------------------------------------------------------------------------ GPT
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


def _batch(cfg=CFG, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g),
            torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g))


def _perturb(model: nn.Module, scale=0.05, seed=1) -> nn.Module:
    """Move every parameter off its initialisation (zero biases, zero Z_tok) so the tests see a general point."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def test_subspace_gpt_layout_parameters_and_buffers():
    torch.manual_seed(0)
    m = GPT(CFG, subspace_rank=8, subspace_seed=3)
    names = dict(m.named_parameters())
    assert names["transformer.h.0.attn.c_proj.weight"].shape == (8, 32)
    assert names["transformer.h.0.mlp.c_proj.weight"].shape == (8, 128)
    assert names["transformer.h.0.attn.c_proj.bias"].shape == (8,)
    assert names["transformer.wte.weight"].shape == (64, 8) and names["transformer.wpe.weight"].shape == (16, 8)
    assert m.lm_head.weight is m.transformer.wte.weight  # tied
    assert not torch.count_nonzero(m.transformer.wte.weight)  # Z_tok starts at zero: embedding = E_fix
    buffers = dict(m.named_buffers())
    assert set(buffers) == {"transformer.wte.U", "transformer.wte.E_fix"}  # one tensor each, shared by modules
    assert all(not b.requires_grad for b in buffers.values())
    assert not {id(b) for b in buffers.values()} & {id(p) for p in m.parameters()}
    assert torch.equal(buffers["transformer.wte.U"], orthonormal_basis(32, 8, 3))
    assert torch.equal(buffers["transformer.wte.E_fix"], fixed_embedding(64, 32, 3))
    sd = m.state_dict()  # buffers are saved (a checkpoint carries the basis it was trained with)
    assert torch.equal(sd["transformer.h.3.mlp.c_proj.U"], buffers["transformer.wte.U"])
    # fewer trainable numbers than the plain model: k instead of d in every residual write
    plain = sum(p.numel() for p in GPT(CFG).parameters())
    d, k, v, t, L = 32, 8, 64, 16, 4
    assert sum(p.numel() for p in m.parameters()) == plain - (d - k) * (v + t + L * (d + 1 + 4 * d + 1))
    assert m.num_parameters() == sum(p.numel() for p in m.parameters()) - t * k


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"subspace_rank": 0}, ValueError, r"subspace_rank must be None or an int in \[1, n_embd=32\], got 0"),
    ({"subspace_rank": 33}, ValueError, r"subspace_rank must be None or an int in \[1, n_embd=32\]"),
    ({"subspace_rank": 4.0}, TypeError, "subspace_rank must be None or an int"),
    ({"subspace_rank": True}, TypeError, "subspace_rank must be None or an int"),
    ({"subspace_rank": 4, "subspace_seed": -2}, ValueError, r"subspace_seed must be an int in \[0, 2\*\*63\)"),
])
def test_gpt_bad_subspace_arguments_raise_before_anything(kwargs, exc, match):
    rng = torch.get_rng_state()
    with pytest.raises(exc, match=match):
        GPT(CFG, **kwargs)
    assert torch.equal(torch.get_rng_state(), rng)  # nothing was built


def test_plain_gpt_has_no_subspace():
    m = GPT(CFG)
    for call in (m.subspace_codec, lambda: m.subspace_residual(_batch()[0]), lambda: m.load_plain(GPT(CFG))):
        with pytest.raises(RuntimeError, match="built without subspace_rank"):
            call()


def test_full_rank_subspace_gpt_spans_the_plain_gpt():
    """k = d: U is square orthogonal, so W = U·(UᵀW) for every W: the plain model's weights map in exactly."""
    torch.manual_seed(0)
    plain = _perturb(GPT(CFG))
    sub = GPT(CFG, subspace_rank=CFG.n_embd, subspace_seed=11)
    sub.load_plain(plain)
    idx, tgt = _batch()
    with torch.no_grad():
        lp, loss_p = plain(idx, tgt)
        ls, loss_s = sub(idx, tgt)
    torch.testing.assert_close(ls, lp, rtol=0, atol=2e-5)
    assert float(loss_s) == pytest.approx(float(loss_p), rel=1e-6)
    # the state dict form works too, and a mismatched plain model is refused naming the tensor
    again = GPT(CFG, subspace_rank=CFG.n_embd, subspace_seed=11)
    again.load_plain(plain.state_dict())
    torch.testing.assert_close(again(idx)[0], lp, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match=r"configuration at transformer.wte.weight: expected \(64, 32\), got \(64, 16"):
        sub.load_plain(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=16)))
    with pytest.raises(ValueError, match=r"plain has no transformer.h.2.attn.c_proj.weight"):
        sub.load_plain(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)))
    with pytest.raises(ValueError, match="plain must be a GPT built without subspace_rank"):
        sub.load_plain(again)


def test_low_rank_load_plain_is_the_orthogonal_projection():
    torch.manual_seed(0)
    plain = _perturb(GPT(CFG))
    sub = GPT(CFG, subspace_rank=8)
    sub.load_plain(plain)
    U = sub.transformer.wte.U
    W = plain.transformer.h[2].mlp.c_proj.weight.detach()
    torch.testing.assert_close(U @ sub.transformer.h[2].mlp.c_proj.weight.detach(), U @ (U.T @ W))
    torch.testing.assert_close(sub.transformer.h[2].attn.c_attn.weight, plain.transformer.h[2].attn.c_attn.weight)
    sub.check_subspace(_batch()[0])


@pytest.mark.parametrize("k", [1, 8, 32])
def test_residual_stream_stays_in_the_subspace_at_every_block_boundary(k):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.2)
    m = _perturb(GPT(cfg, subspace_rank=k), scale=0.3)
    idx, tgt = _batch(cfg)
    for mode in (m.train, m.eval):  # dropout acts on the coefficients: in the subspace in both modes
        mode()
        found = m.check_subspace(idx)
        assert [w for w, _ in found] == ["embedding", "block 0", "block 1", "block 2", "block 3"]
        assert max(r.max_relative for _, r in found) < 2e-5  # float rounding (k = 1: writes cancel, see tolerance)
    # and after real training steps
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        m(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad()
    assert max(r.max_relative for _, r in m.check_subspace(idx)) < 2e-5


def test_a_module_writing_outside_the_subspace_is_detected():
    torch.manual_seed(0)
    m = _perturb(GPT(CFG, subspace_rank=8))
    idx, _ = _batch()
    m.check_subspace(idx)
    m.transformer.h[1].mlp.c_proj = nn.Linear(4 * CFG.n_embd, CFG.n_embd)  # a user's plain projection
    found = m.subspace_residual(idx)
    assert max(r.max_relative for _, r in found[:2]) < 1e-6  # before block 1: still in the subspace
    assert min(r.max_relative for _, r in found[2:]) > 1e-3  # from block 1 on: not
    with pytest.raises(SubspaceError, match=r"after block 1 is outside E_fix\[tokens\] \+ span\(U\).*SubspaceLinear"):
        m.check_subspace(idx)
    # the codec at a stage boundary refuses it as well
    x = {}
    m.transformer.h[1].register_forward_hook(lambda mod, a, out: x.setdefault("x", out))
    m(idx)
    with pytest.raises(SubspaceError, match="at boundary_out"):
        m.subspace_codec().boundary_out(x["x"], idx)


def _stages(m: GPT, idx: torch.Tensor, cut: int):
    """The two halves of ``m`` as two pipeline stages would run them (the model code's forward, by hand)."""
    pos = torch.arange(idx.shape[1])

    def first(idx):
        x = m.transformer.drop(m.transformer.wte(idx) + m.transformer.wpe(pos))
        for block in m.transformer.h[:cut]:
            x = block(x)
        return x

    def second(x, tgt):
        for block in m.transformer.h[cut:]:
            x = block(x)
        logits = m.lm_head(m.transformer.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.reshape(-1))

    return first, second


@pytest.mark.parametrize("k", [4, 32])
def test_two_stages_through_the_boundary_pair_equal_the_unsplit_model(k):
    torch.manual_seed(0)
    m = _perturb(GPT(CFG, subspace_rank=k))
    idx, tgt = _batch()
    loss = m(idx, tgt)[1]
    loss.backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()

    codec = m.subspace_codec()
    first, second = _stages(m, idx, CFG.n_layer // 2)
    c = codec.boundary_out(first(idx), idx)  # stage 0: send c
    assert c.shape == (3, 16, k)
    received = c.detach().requires_grad_()  # the wire: only c crosses
    split_loss = second(codec.boundary_in(received, idx), tgt)  # stage 1
    split_loss.backward()
    grad_c = received.grad  # the wire back: only ∂L/∂c crosses
    assert grad_c.shape == (3, 16, k)
    wire = codec.wire_bytes(3, 16)
    assert c.numel() * c.element_size() == wire.forward and grad_c.numel() * grad_c.element_size() == wire.backward
    c.backward(grad_c)  # stage 0 backward from the received gradient

    torch.testing.assert_close(split_loss, loss, rtol=1e-6, atol=0)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6, msg=n)
    assert all(b.grad is None for b in m.buffers())


def test_basis_and_fixed_embedding_never_change_under_an_optimizer():
    torch.manual_seed(0)
    m = GPT(CFG, subspace_rank=8, subspace_seed=2)
    idx, tgt = _batch()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for _ in range(4):
        m(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(p, before[n]) for n, p in m.named_parameters())  # everything trainable moved
    for name, t in m.state_dict().items():
        if name.endswith(".U"):
            assert torch.equal(t, orthonormal_basis(32, 8, 2)), name
        if name.endswith(".E_fix"):
            assert torch.equal(t, fixed_embedding(64, 32, 2)), name


def _fgdiloco_run(rank: int, world: int) -> dict:
    torch.manual_seed(100 + rank)  # different starts: broadcast_init makes them equal
    m = GPT(CFG, subspace_rank=8, subspace_seed=5)
    opt = FGDiLoCo(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync_every=2, topology="allreduce",
                   outer_momentum=0.0, timeout=20.0)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):
        idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
        m(idx, idx)[1].backward()
        opt.step()
        opt.zero_grad()
    return {"synchronised": list(opt.param_names),
            "buffers": {n: hashlib.sha256(b.numpy().tobytes()).hexdigest() for n, b in m.state_dict().items()
                        if n.endswith((".U", ".E_fix"))},
            "params": [p.detach().flatten().tolist() for p in m.parameters()]}


def test_fgdiloco_synchronises_parameters_only_and_leaves_the_basis_alone(tmp_path):
    a, b = run_ranks(_fgdiloco_run, 2, tmp_path)
    assert a["params"] == b["params"]  # the all-reduce rounds ran
    assert not [n for n in a["synchronised"] if n.endswith((".U", ".E_fix"))]
    assert "transformer.wte.weight" in a["synchronised"]
    want = {"U": hashlib.sha256(orthonormal_basis(32, 8, 5).numpy().tobytes()).hexdigest(),
            "E_fix": hashlib.sha256(fixed_embedding(64, 32, 5).numpy().tobytes()).hexdigest()}
    assert a["buffers"] == b["buffers"] and a["buffers"]
    assert all(h == want[n.rsplit(".", 1)[1]] for n, h in a["buffers"].items())


@pytest.mark.parametrize("k", [None, 8])
def test_benchmark_two_stage_step_matches_the_chained_stages_and_counts_what_crosses(k):
    from fgdiloco.pretrain.model import two_stage_loss as held_out_loss
    from fgdiloco.pretrain.model import two_stage_step

    torch.manual_seed(0)
    stages = _perturb(GPT(CFG, subspace_rank=k, subspace_stages=None if k is None else 2)).split(2)
    idx, tgt = _batch()
    want_loss = nn.functional.cross_entropy(stages[1](stages[0](idx)).reshape(-1, CFG.vocab_size), tgt.reshape(-1))
    want_loss.backward()
    want = [{n: p.grad.clone() for n, p in s.named_parameters()} for s in stages]
    for s in stages:
        s.zero_grad()
    codec = None if k is None else stages[0].subspace_codec()
    got, fwd, bwd = two_stage_step(stages, idx, tgt, codec)
    assert got == pytest.approx(float(want_loss.detach()), rel=1e-6)
    per_token = CFG.n_embd if k is None else k
    assert fwd == bwd == idx.numel() * per_token * 4
    for s, w in zip(stages, want):
        for n, p in s.named_parameters():
            torch.testing.assert_close(p.grad, w[n], rtol=1e-4, atol=1e-6, msg=n)
    assert held_out_loss(stages, codec, [(idx, tgt)]) == pytest.approx(float(want_loss.detach()), rel=1e-5)


# ------------------------------------------------------------------------------------------------ only what crosses
CFG6 = GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32)


def _chain(stages, idx, tgt, codec=None):
    """The stages run one after the other as a pipeline would, the stream sent as it is (``codec=None``) or as
    c through the codec's boundary pair; returns the loss and each stage's parameter gradients."""
    x, sent = idx, []
    for s, stage in enumerate(stages):
        if s > 0:  # the wire: what the previous stage sent arrives as a new leaf
            received = sent[-1].detach().requires_grad_()
            x = received if codec is None else codec.boundary_in(received, idx)
            sent[-1] = (sent[-1], received)
        x = stage(x)
        if s < len(stages) - 1:
            sent.append(x if codec is None else codec.boundary_out(x, idx))
            x = None
    loss = nn.functional.cross_entropy(x.reshape(-1, x.size(-1)), tgt.reshape(-1))
    loss.backward()
    for out, received in reversed(sent):  # every stage's backward from the gradient that came back
        out.backward(received.grad)
    grads = [{n: p.grad.clone() for n, p in stage.named_parameters()} for stage in stages]
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return loss.detach(), grads, [received.grad.shape for _, received in sent]


@pytest.mark.parametrize(("cfg", "S", "k"), [(CFG, 2, 4), (CFG, 4, 8), (CFG6, 3, 4), (CFG6, 2, 1)])
def test_only_the_writes_that_cross_a_boundary_are_constrained(cfg, S, k):
    """``subspace_stages=S``: the embeddings and every block before the last stage of ``split(S)`` write through
    U, the last stage's blocks are plain (their writes leave span(U)); every boundary of the split stays lossless:
    sending c instead of x changes neither the loss nor any gradient."""
    torch.manual_seed(0)
    model = _perturb(GPT(cfg, subspace_rank=k, subspace_stages=S), scale=0.1)
    last = model.split(S)[-1].layers
    assert model.subspace_layers == range(last.start) and model.subspace_stages == S
    for i, block in enumerate(model.transformer.h):
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            assert type(proj) is (SubspaceLinear if i < last.start else nn.Linear), (i, proj)
    idx, tgt = _batch(cfg)
    # train a few steps: the free blocks move in all d directions, the constrained ones only inside span(U)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        model(idx, tgt)[1].backward()
        opt.step()
        opt.zero_grad()
    found = dict(model.subspace_residual(idx))
    assert list(found) == ["embedding"] + [f"block {i}" if i < last.start else f"block {i} (free)"
                                           for i in range(cfg.n_layer)]
    assert max(r.max_relative for w, r in found.items() if "free" not in w) < 2e-5
    assert min(r.max_relative for w, r in found.items() if "free" in w) > 1e-2  # left the subspace
    model.check_subspace(idx)  # checks only the constrained boundaries: passes
    # the writes of a free block themselves (not only the stream) have a component outside span(U)
    U = model.transformer.wte.U
    free = model.transformer.h[last.start]
    with torch.no_grad():
        stream = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(cfg.block_size))
        for block in model.transformer.h[:last.start]:
            stream = block(stream)
        write = free(stream) - stream
    assert float((write - write @ U @ U.T).norm() / write.norm()) > 0.5
    # every boundary of split(S): c reconstructs the stream exactly, and the compressed chain is the plain chain
    stages = model.split(S)
    codec = stages[0].subspace_codec()
    h = idx
    for stage in stages[:-1]:
        h = stage(h)
        torch.testing.assert_close(codec.decompress(*codec.compress(h, idx)), h, rtol=0, atol=1e-5)
    want_loss, want, _ = _chain(stages, idx, tgt)
    got_loss, got, shapes = _chain(stages, idx, tgt, codec)
    assert shapes == [torch.Size([idx.shape[0], cfg.block_size, k])] * (S - 1)  # k numbers per token go back
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for s in range(S):
        for name in want[s]:
            torch.testing.assert_close(got[s][name], want[s][name], rtol=1e-4, atol=1e-6, msg=f"stage {s} {name}")


def test_a_model_built_for_s_stages_refuses_a_split_past_its_constrained_blocks():
    torch.manual_seed(0)
    model = GPT(CFG, subspace_rank=8, subspace_stages=2)  # blocks 0, 1 constrained; 2, 3 free
    with pytest.raises(ValueError, match=r"split\(3\) cuts the stream after block 2, but this model "
                                         r"\(subspace_stages=2\) constrains only blocks 0\.\.1.*subspace_stages=3"):
        model.split(3)
    assert len(model.split(1)) == 1 and len(model.split(2)) == 2
    six = GPT(CFG6, subspace_rank=8, subspace_stages=3)  # stages [0,2) [2,4) [4,6): blocks 0..3 constrained
    assert six.subspace_layers == range(4)
    assert [s.layers for s in six.split(2)] == [range(0, 3), range(3, 6)]  # cut after block 2: inside
    with pytest.raises(ValueError, match="cuts the stream after block 4"):
        six.split(6)
    assert all(len(GPT(CFG, subspace_rank=8).split(S)) == S for S in (1, 2, 3, 4))  # None: any split
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)] and stage_layers(5, 3) == [range(0, 2), range(2, 4),
                                                                                       range(4, 5)]


@pytest.mark.parametrize(("value", "exc", "match"), [
    (1, ValueError, r"subspace_stages must be None or an int in \[2, n_layer=4\].*got 1; one stage has no "
                    r"boundary"),
    (5, ValueError, r"subspace_stages must be None or an int in \[2, n_layer=4\]"),
    (2.0, TypeError, "subspace_stages must be None or an int"),
    (True, TypeError, "subspace_stages must be None or an int"),
])
def test_bad_subspace_stages_raise_before_anything(value, exc, match):
    rng = torch.get_rng_state()
    with pytest.raises(exc, match=match):
        GPT(CFG, subspace_rank=4, subspace_stages=value)
    assert torch.equal(torch.get_rng_state(), rng)


def test_free_blocks_count_and_load_as_the_plain_model():
    torch.manual_seed(0)
    plain = _perturb(GPT(CFG))
    m = GPT(CFG, subspace_rank=8, subspace_stages=2)
    d, k, v, t = 32, 8, 64, 16
    n_plain = sum(p.numel() for p in plain.parameters())
    # only the embeddings and the two constrained blocks train k instead of d numbers per residual write
    assert sum(p.numel() for p in m.parameters()) == n_plain - (d - k) * (v + t + 2 * (d + 1 + 4 * d + 1))
    assert GPT(CFG, subspace_stages=2).subspace_layers == range(0)  # ignored without subspace_rank
    full = GPT(CFG, subspace_rank=d, subspace_stages=2)
    full.load_plain(plain)  # k = d: exact, the free blocks copied as they are
    idx, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(full(idx)[0], plain(idx)[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(full.transformer.h[3].mlp.c_proj.weight, plain.transformer.h[3].mlp.c_proj.weight)


# ------------------------------------------------------------------------------------------------ where it lives
def test_the_codec_moved_to_the_pipeline_and_the_old_names_warn():
    import fgdiloco.factor as factor
    import fgdiloco.pipeline as pipeline
    import fgdiloco.pipeline.subspace as new

    for name in ("BoundaryIn", "BoundaryOut", "SubspaceActivationCodec", "SubspaceBasis", "SubspaceCodec",
                 "SubspaceError", "fixed_embedding", "orthonormal_basis", "default_tolerance", "Residual"):
        with pytest.warns(DeprecationWarning, match=rf"fgdiloco\.factor\.{name} has moved to "
                                                    rf"fgdiloco\.pipeline\.subspace\.{name}"):
            assert getattr(factor, name) is getattr(new, name)
    with pytest.warns(DeprecationWarning, match="fgdiloco.pipeline.subspace"):
        from fgdiloco.factor import SubspaceCodec as Old
    assert Old is SubspaceCodec is pipeline.SubspaceCodec
    assert not set(factor.__all__) & {"SubspaceCodec", "SubspaceBasis"}  # a star import does not warn
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        factor.Nope  # noqa: B018


@pytest.mark.slow
def test_the_gossip_codecs_never_import_the_pipeline():
    import ast

    root = Path(__file__).resolve().parents[1] / "fgdiloco" / "factor"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [("." * node.level) + (node.module or "")] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if "pipeline" in n], f"{path.name} imports {names}"
    code = ("import sys, warnings; import fgdiloco.factor as f; assert 'fgdiloco.pipeline' not in sys.modules; "
            "warnings.simplefilter('ignore'); f.SubspaceCodec; assert 'fgdiloco.pipeline.subspace' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_stage_embeddings_keep_the_boundary_in_the_subspace_and_the_split_exact():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg, subspace_rank=4, subspace_seed=1, subspace_stages=2, stage_embeddings=True)
    plain_sub = GPT(cfg, subspace_rank=4, subspace_seed=1, subspace_stages=2)
    added = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in plain_sub.parameters())
    # one token + position table per stage, and the receiving stage's gate
    assert added == 2 * (cfg.vocab_size + cfg.block_size) * cfg.n_embd + 1
    idx = torch.randint(0, cfg.vocab_size, (3, 16))
    found = dict(model.check_subspace(idx))  # the constrained boundaries are in E_fix + span(U) to rounding
    assert found["block 1"].max_relative < 1e-5
    assert found["block 3 (free)"].max_relative > 1e-2  # the last stage's own embedding is in its stream
    first, last = model.split(2)
    assert first.stage_embedding is not None and last.stage_embedding is not None
    codec = first.subspace_codec()
    x = first(idx)
    logits = last(codec.decompress(*codec.compress(x, idx)), idx)
    torch.testing.assert_close(logits, model(idx)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="stage 1 re-embeds the tokens"):
        last(codec.decompress(*codec.compress(x, idx)))
    with pytest.raises(ValueError, match="split it into 2 stages"):
        model.split(1)
    # the stage's own embedding trains: a step moves it and the stream at the boundary stays in the subspace
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(idx, idx)[1].backward()
    before = model.stage_embeddings[0].wte.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.stage_embeddings[0].wte.weight)
    assert dict(model.check_subspace(idx))["block 1"].max_relative < 1e-5


def test_a_receiving_stage_starts_without_what_it_receives_and_its_gate_keeps_every_boundary_lossless():
    """The gate of every stage after the first is zero at initialisation: the stage reads E_fix[tokens] and its own
    embedding only (changing what the first stage sends changes nothing), and the stages before it get no gradient
    through the boundary; the gates open from the last backwards, and with any gates a middle stage's boundary is
    in the subspace and the 3-way split equals the unsplit model."""
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=6, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg, subspace_rank=4, subspace_seed=1, subspace_stages=3, stage_embeddings=True)
    assert model.stage_embeddings[0].gate is None
    assert [float(e.gate.detach()) for e in model.stage_embeddings[1:]] == [0.0, 0.0]
    idx = torch.randint(0, cfg.vocab_size, (3, 16))
    first, middle, last = model.split(3)
    codec = first.subspace_codec()
    c, _ = codec.compress(first(idx), idx)
    before = last(codec.decompress(*codec.compress(middle(codec.decompress(c, idx), idx), idx)), idx)
    after = last(codec.decompress(*codec.compress(middle(codec.decompress(c + 5.0, idx), idx), idx)), idx)
    torch.testing.assert_close(before, after, rtol=0, atol=1e-5)  # the first stage's coefficients are not read yet
    loss = model(idx, idx)[1]
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.transformer.h[0].parameters())
    # the last stage's gate trains from the first step; the middle one's once the gate after it has opened
    assert float(model.stage_embeddings[2].gate.grad) != 0.0 and float(model.stage_embeddings[1].gate.grad) == 0.0
    with torch.no_grad():
        for e, g in zip(model.stage_embeddings[1:], (0.7, -1.3)):
            e.gate.fill_(g)
    found = dict(model.check_subspace(idx))
    assert max(found[f"block {i}"].max_relative for i in range(4)) < 1e-5  # both boundaries lossless
    first, middle, last = model.split(3)
    codec = first.subspace_codec()
    x = codec.decompress(*codec.compress(first(idx), idx))
    logits = last(codec.decompress(*codec.compress(middle(x, idx), idx)), idx)
    torch.testing.assert_close(logits, model(idx)[0], rtol=1e-5, atol=1e-5)


def test_a_checkpoint_from_before_the_gate_loads_with_the_gate_open():
    """A state dict without the gates (saved before they existed) loads strictly, each gate at 1: the stream is
    admitted as it is, the model it was saved from."""
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg, subspace_rank=4, subspace_seed=1, subspace_stages=2, stage_embeddings=True)
    old = {k: v for k, v in model.split(2)[1].state_dict().items() if not k.endswith("gate")}
    assert len(old) == len(model.split(2)[1].state_dict()) - 1
    last = model.split(2)[1]
    last.load_state_dict(old)
    assert float(last.stage_embedding.gate.detach()) == 1.0
    x, idx = torch.randn(2, 16, 32), torch.randint(0, cfg.vocab_size, (2, 16))
    torch.testing.assert_close(last.stage_embedding.admit(x, last.E_fix[idx]), x, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"subspace_rank": 4, "stage_embeddings": True}, ValueError, "needs subspace_rank and subspace_stages"),
    ({"stage_embeddings": True}, ValueError, "needs subspace_rank and subspace_stages"),
    ({"subspace_rank": 4, "subspace_stages": 2, "stage_embeddings": 1}, TypeError, "stage_embeddings must be a bool"),
])
def test_bad_stage_embeddings_raise_before_anything(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=4, n_head=2, n_embd=32), **kwargs)


def test_the_example_job_builds_stage_embeddings_for_a_split_subspace_model_unless_told_not_to():
    import argparse

    from fgdiloco.pretrain.config import TrainConfig, add_train_arguments
    from fgdiloco.pretrain.recipe import build_model

    small = {"workers": 2, "stages": 2, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16}
    assert len(build_model(TrainConfig(**small, subspace_rank=4), 50).stage_embeddings) == 2
    assert build_model(TrainConfig(**small, subspace_rank=4, stage_embeddings=False), 50).stage_embeddings is None
    assert build_model(TrainConfig(**small), 50).stage_embeddings is None  # the plain model has none
    assert build_model(TrainConfig(**{**small, "stages": 1, "workers": 2}, subspace_rank=4),
                       50).stage_embeddings is None  # one stage: nothing crosses, every block constrained
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    assert TrainConfig.from_arguments(p.parse_args(["--no-stage-embeddings"])).stage_embeddings is False
    assert TrainConfig.from_arguments(p.parse_args([])).stage_embeddings is True
    # a run saved before stage embeddings existed resumes without them
    assert TrainConfig.from_dict({"subspace_rank": 4}).stage_embeddings is False


# ------------------------------------------------------------------------------------------------ autocast
def _docs_stages(seed=0):
    """The one-process example of docs/pipelines.md (weights moved off their initialisation): two stages of one
    seeded subspace GPT, their codecs, a batch."""
    from fgdiloco.pretrain import activation_codec_for, build_stage

    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    first, last = (build_stage(config, 2, stage, subspace_rank=4, seed=0, stage_embeddings=True) for stage in (0, 1))
    _perturb(first, seed=1)
    _perturb(last, seed=2)  # opens the receiving stage's gate: it reads what crosses
    idx = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(seed))
    return first, last, activation_codec_for(first), activation_codec_for(last), idx[:, :-1], idx[:, 1:]


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_the_docs_example_encodes_and_decodes_under_bf16_autocast():
    """An fp32 stream whose writes were rounded to bf16 under autocast passes the check (the tolerance follows the
    autocast dtype), c and dL/dc keep the stream's dtype (the bytes sent are those without autocast), and the
    compressed boundary gives the uncompressed pipeline's logits and gradients to bf16 rounding."""
    from fgdiloco.pretrain import lm_loss

    first, last, send, receive, x, y = _docs_stages()
    with _bf16():
        h = first(x)
        assert h.dtype == torch.float32 and send.codec.residual(h, x).max_relative > default_tolerance(torch.float32)
        c = send.encode(h, inputs=x)
        wire = c.detach().requires_grad_()
        got, tokens = receive.decode(wire, inputs=x)
        logits = last(got, tokens)
        lm_loss(logits, y).backward()
        projected = send.codec.decompress(*send.codec.compress(h.detach(), x))  # checked under autocast too
    c.backward(wire.grad)
    # what crosses: k = 4 fp32 numbers per token each way, as without autocast
    assert c.dtype == wire.grad.dtype == torch.float32 and c.shape == wire.grad.shape == (8, 16, 4)
    want = send.wire_bytes(8, 16, torch.float32)
    assert (c.numel() * c.element_size(), wire.grad.numel() * wire.grad.element_size()) == (want.forward,
                                                                                             want.backward)
    # the decoded stream is the projection of the sent one: exact to fp32 rounding, off by the bf16 rounding only
    assert got.dtype == projected.dtype == torch.float32
    torch.testing.assert_close(got, projected, rtol=1e-5, atol=1e-6)
    assert float((got - h).detach().norm() / h.detach().norm()) < 1e-2
    got_grads = [p.grad.clone() for p in first.parameters()]
    # the uncompressed pipeline under the same autocast: the stream itself crosses
    first.zero_grad()
    last.zero_grad()
    with _bf16():
        h = first(x)
        dense = h.detach().requires_grad_()
        plain_logits = last(dense, x)
        lm_loss(plain_logits, y).backward()
    h.backward(dense.grad)
    torch.testing.assert_close(logits, plain_logits, rtol=2e-2, atol=2e-2)
    for g, p in zip(got_grads, first.parameters()):  # what bf16 rounding leaves: 0.3 - 0.9 % of each gradient
        assert float((g - p.grad).norm()) <= 2e-2 * float(p.grad.norm()) and float(p.grad.norm()) > 0


def test_a_stream_outside_the_subspace_is_still_caught_under_bf16_autocast():
    first, _, send, _, x, _ = _docs_stages()
    outside = torch.zeros(32)
    outside[0] = 1.0
    U = send.codec.basis.U
    outside -= U @ (U.T @ outside)
    outside /= outside.norm()
    with _bf16():
        h = first(x)
        send.encode(h, inputs=x)  # in the subspace to bf16 rounding: accepted
        bad = h.detach().clone()
        bad[2, 5] += 0.1 * bad[2, 5].norm() * outside  # one token, 10 % of its norm off the subspace
        with pytest.raises(SubspaceError, match=r"0\.099\d* of ‖x‖.*tolerance 0\.03 for torch\.float32 computed under "
                                                r"torch\.bfloat16 autocast"):
            send.encode(bad, inputs=x)
        with pytest.raises(SubspaceError, match="at boundary_out"):
            send.codec.boundary_out(bad, x)
    # a module writing outside span(U): a user's plain projection in the sending stage
    torch.manual_seed(0)
    first.h[0].mlp.c_proj = nn.Linear(4 * 32, 32)
    with _bf16(), pytest.raises(SubspaceError, match="computed under torch.bfloat16 autocast"):
        send.encode(first(x), inputs=x)
    # and the model-wide check follows autocast the same way
    torch.manual_seed(0)
    m = _perturb(GPT(CFG, subspace_rank=8))
    idx, _ = _batch()
    with _bf16():
        assert max(r.max_relative for _, r in m.check_subspace(idx)) > default_tolerance(torch.float32)
    m.transformer.h[1].mlp.c_proj = nn.Linear(4 * CFG.n_embd, CFG.n_embd)
    with _bf16(), pytest.raises(SubspaceError, match="after block 1"):
        m.check_subspace(idx)


def test_compute_dtype_is_the_coarser_of_the_stream_and_autocast():
    from fgdiloco.pipeline.subspace import compute_dtype

    x32, x64, x16 = torch.zeros(2), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float16)
    assert [compute_dtype(t) for t in (x32, x64, x16)] == [torch.float32, torch.float64, torch.float16]
    with _bf16():
        # autocast computes fp32 and fp16 in bf16, leaves fp64 alone
        assert [compute_dtype(t) for t in (x32, x64, x16)] == [torch.bfloat16, torch.float64, torch.bfloat16]
        with torch.autocast("cpu", enabled=False):
            assert compute_dtype(x32) == torch.float32
    assert compute_dtype(torch.zeros(2, device="meta")) == torch.float32  # no autocast on that device type

"""Subspace compression of the activations between pipeline stages (Ramasinghe et al., arXiv 2506.01260).

The seeded basis, the activation codec and its autograd boundary pair, and the example GPT reparametrised so that
its residual stream stays in E_fix[tokens] + span(U).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fgdiloco.pretrain.model import GPT, GPTConfig

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
        loss=float(loss),
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

"""The analytic round model of ``fgdiloco simulate``: it lives in :mod:`fgdiloco.pretrain.simulate` (it measures the
example job's GPT); this module keeps ``from fgdiloco.simulate import predict`` working."""

from .pretrain.simulate import *  # noqa: F403 - the model, re-exported

"""Pretraining a small GPT on real text: the model, the data pipeline and the distributed job.

* :mod:`fgdiloco.pretrain.model`: ``GPTConfig``, ``GPT`` (nanoGPT-style decoder; ``GPT.split`` into pipeline
  stages ``GPTStage``, with ``lm_loss``; ``build_stage`` / ``activation_codec_for`` for a rank's stage and its
  boundary codec, subspace or not).
* :mod:`fgdiloco.pretrain.data`: ``load_text``, ``build_tokenizer``, ``encode_corpus``, ``split_tokens``,
  ``sample_batch``, ``unigram_loss``; a public-domain default corpus ships in ``corpus/``.
* :mod:`fgdiloco.pretrain.worker`: ``TrainConfig``, ``train_worker`` (one rank), ``launch`` (local workers via
  torchelastic); the ``fgdiloco pretrain`` command runs it.
"""

from .data import build_tokenizer, encode_corpus, load_text, sample_batch, split_tokens, unigram_loss
from .model import GPT, GPTConfig, GPTStage, activation_codec_for, build_stage, lm_loss
from .worker import TrainConfig, launch, train_worker

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTStage",
    "TrainConfig",
    "activation_codec_for",
    "build_stage",
    "build_tokenizer",
    "encode_corpus",
    "launch",
    "lm_loss",
    "load_text",
    "sample_batch",
    "split_tokens",
    "train_worker",
    "unigram_loss",
]

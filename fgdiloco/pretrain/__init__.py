"""Pretraining a small GPT on real text: the model, the data pipeline and the distributed job.

* :mod:`fgdiloco.pretrain.model`: ``GPTConfig``, ``GPT`` (nanoGPT-style decoder; ``GPT.split`` into pipeline
  stages ``GPTStage``, with ``lm_loss``; ``build_stage`` / ``activation_codec_for`` for a rank's stage and its
  boundary codec, subspace or not).
* :mod:`fgdiloco.pretrain.data`: ``load_text``, ``build_tokenizer``, ``encode_corpus``, ``split_tokens``,
  ``sample_batch``, ``unigram_loss``; a public-domain default corpus ships in ``corpus/``.
* :mod:`fgdiloco.pretrain.worker`: ``TrainConfig``, ``train_worker`` (one rank).
* :mod:`fgdiloco.pretrain.launcher`: ``preflight`` (checks before any worker starts), ``launch`` (local workers:
  elastic ones, each its own torchrun job, or one torchelastic job for baselines and pipeline stages),
  ``finish_interrupted`` (the summary after Ctrl-C); the ``fgdiloco pretrain`` command runs them.
* :mod:`fgdiloco.pretrain.elastic_worker`: one elastic worker (its reports and checkpoints);
  :mod:`fgdiloco.pretrain.merge`: ``Merger``, the launcher's merge of the workers' reports into rows.
* :mod:`fgdiloco.pretrain.results`: what a run writes (``run.json``, ``metrics.jsonl``, ``summary.json``,
  ``loss.png``), the meaning of every field, ``summarise``.
"""

from .data import build_tokenizer, encode_corpus, load_text, sample_batch, split_tokens, unigram_loss
from .launcher import finish_interrupted, launch, preflight
from .model import GPT, GPTConfig, GPTStage, activation_codec_for, build_stage, lm_loss
from .worker import TrainConfig, train_worker

__all__ = [
    "GPT",
    "GPTConfig",
    "GPTStage",
    "TrainConfig",
    "activation_codec_for",
    "build_stage",
    "build_tokenizer",
    "encode_corpus",
    "finish_interrupted",
    "launch",
    "lm_loss",
    "load_text",
    "preflight",
    "sample_batch",
    "split_tokens",
    "train_worker",
    "unigram_loss",
]

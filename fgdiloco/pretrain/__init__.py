"""Pretraining a small GPT on real text: the model, the data pipeline and the distributed job (``fgdiloco pretrain``;
needs the ``[pretrain]`` extra: tokenizers, matplotlib, rich).

* :mod:`fgdiloco.pretrain.config`: ``TrainConfig`` (the job's settings, every ``FGDiLoCoConfig`` setting among
  them), ``DEPARTURES``, the command's flags.
* :mod:`fgdiloco.pretrain.model`: ``GPTConfig``, ``GPT`` (nanoGPT-style decoder; ``GPT.split`` into pipeline
  stages ``GPTStage``, with ``lm_loss``; ``build_stage`` / ``activation_codec_for`` for a rank's stage and its
  boundary codec, subspace or not; ``fragments_of`` for Streaming DiLoCo's fragments).
* :mod:`fgdiloco.pretrain.data`: ``load_text``, ``build_tokenizer``, ``encode_corpus``, ``split_tokens``,
  ``sample_batch``, ``unigram_loss``; a public-domain default corpus ships in ``corpus/``.
* :mod:`fgdiloco.pretrain.recipe`: the training recipe every trainer of the job shares (tokens, seeded model,
  AdamW, learning-rate schedule, batches, clipping, held-out loss).
* :mod:`fgdiloco.pretrain.loop`: the one training loop, with a pluggable synchroniser and reporter;
  :mod:`fgdiloco.pretrain.sync`: the synchronisers (DDP, local SGD, FG-DiLoCo, a pipeline stage, elastic
  FG-DiLoCo); :mod:`fgdiloco.pretrain.reports`: the reporters (a group job's collective rows, an elastic worker's
  own reports).
* :mod:`fgdiloco.pretrain.worker`: ``train_worker`` (one rank of a group job);
  :mod:`fgdiloco.pretrain.elastic_worker`: one elastic worker.
* :mod:`fgdiloco.pretrain.launcher`: ``preflight`` (checks before any worker starts), ``launch`` (local workers:
  elastic ones, each its own torchrun job, or one torchelastic job for baselines and pipeline stages),
  ``finish_interrupted`` (the summary after Ctrl-C); the ``fgdiloco pretrain`` command runs them.
* :mod:`fgdiloco.pretrain.merge`: ``Merger``, the launcher's merge of elastic workers' reports into rows, and the
  merge of a benchmark's per-rank rows.
* :mod:`fgdiloco.pretrain.results`: what a run writes (``run.json``, ``metrics.jsonl``, ``summary.json``,
  ``loss.png``), the meaning of every field, ``summarise``.
* :mod:`fgdiloco.pretrain.comparison`: side-by-side runs of the job (``benchmarks/wan.py``'s job and methods, time
  and tokens to a target loss, the cost of a dead worker).
* :mod:`fgdiloco.pretrain.simulate`: the analytic round model of ``fgdiloco simulate``.
"""

from .config import DEPARTURES, TrainConfig
from .data import build_tokenizer, encode_corpus, load_text, sample_batch, split_tokens, unigram_loss
from .launcher import finish_interrupted, launch, preflight
from .model import GPT, GPTConfig, GPTStage, activation_codec_for, build_stage, lm_loss
from .worker import train_worker

__all__ = [
    "DEPARTURES",
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

"""Text, tokenizers and batches for the pretraining examples.

* :func:`load_text`: a UTF-8 file, a folder of ``.txt`` files (sorted order), or the bundled public-domain corpus.
* :func:`build_tokenizer`: a byte-level BPE trained with the ``tokenizers`` package (cached, keyed by a hash of the
  text and the vocabulary size), or raw UTF-8 bytes; :func:`tokenizer_is_cached` says whether it will be loaded.
* :func:`encode_corpus`, :func:`split_tokens`, :func:`sample_batch`: token ids, a held-out tail, random windows.
* :func:`unigram_loss`: the cross-entropy a model that ignores context reaches; a trained model must beat it.

Caches are written atomically (temporary name, then ``os.replace``), so concurrent runs never read half a file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "bundled_corpus_dir",
    "cache_dir_for",
    "encode_corpus",
    "load_text",
    "sample_batch",
    "split_tokens",
    "tokenizer_is_cached",
    "unigram_loss",
    "user_cache_dir",
]

CACHE_VERSION = 1
_CACHE_SUBDIR = ".fgdiloco-cache"


class Tokenizer(Protocol):
    """What the pretraining code needs from a tokenizer."""

    vocab_size: int
    kind: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def bundled_corpus_dir() -> Path:
    """The folder of the bundled default corpus (public-domain English, ~2 MB; see its README)."""
    return Path(__file__).resolve().parent / "corpus"


def _text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".txt")


def load_text(path: str | os.PathLike[str] | None) -> str:
    """Read the training text.

    Args:
        path: a UTF-8 text file, a folder whose ``.txt`` files are read in sorted order and concatenated, or
            ``None`` for the bundled default corpus.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a folder without ``.txt`` files, a file that is not UTF-8 text, or no text at all.
    """
    if path is None:
        src = bundled_corpus_dir()
    else:
        src = Path(path).expanduser()
        if not src.exists():
            raise FileNotFoundError(f"training text not found: {str(src)!r} (give a UTF-8 text file or a folder of "
                                    ".txt files)")
    files = _text_files(src) if src.is_dir() else [src]
    if not files:
        raise ValueError(f"folder {str(src)!r} holds no .txt files to train on")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{str(f)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except IsADirectoryError:
            raise ValueError(f"{str(f)!r} is not a regular file") from None
    text = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts) if len(parts) > 1 else parts[0]
    if not text.strip():
        raise ValueError(f"no text in {str(src)!r}")
    return text


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fgdiloco`` (default ``~/.cache/fgdiloco``), the XDG base-directory convention."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fgdiloco"


def cache_dir_for(path: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where to cache the tokenizer and token ids of the text at ``path`` (``None``: the bundled corpus).

    ``cache_dir`` when given; :func:`user_cache_dir` for the bundled corpus or any data inside the installed
    package (a package folder is never written to); otherwise ``.fgdiloco-cache/`` beside the data (in the
    folder, or beside the file) when that is writable, else :func:`user_cache_dir`.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if path is None:
        return user_cache_dir()
    src = Path(path).expanduser().resolve()
    if src.is_relative_to(Path(__file__).resolve().parents[1]):
        return user_cache_dir()
    folder = src if src.is_dir() else src.parent
    if os.access(folder, os.W_OK | os.X_OK):
        beside = folder / _CACHE_SUBDIR
        if _writable(beside):
            return beside
    return user_cache_dir()


def _atomic_write(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a temporary file and ``os.replace``; failures are ignored (a cache)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode("utf-8") if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:16]


class ByteTokenizer:
    """Raw UTF-8 bytes: token id = byte value, ``vocab_size`` 256. Decoding replaces invalid sequences."""

    kind = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "bytes"

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class BPETokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenisation) from the ``tokenizers`` package; any text round-trips."""

    kind = "bpe"

    def __init__(self, tokenizer: object, path: Path | None = None):
        self._tok = tokenizer
        self.path = path
        self.vocab_size = int(tokenizer.get_vocab_size())

    @classmethod
    def train(cls, text: str, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=[], show_progress=False)
        tok.train_from_iterator(_chunks(text), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_json(cls, data: str, path: Path | None = None) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_str(data), path)

    def to_json(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        return _sha(self.to_json())

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size})"


def _chunks(text: str, size: int = 1 << 16) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters at line ends (pieces concatenate back to ``text``)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def _tokenizer_path(text: str, vocab_size: int, cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / f"bpe-{vocab_size}-{_sha(f'v{CACHE_VERSION}', text)}.tokenizer.json"


def tokenizer_is_cached(text: str, vocab_size: int, cache_dir: str | os.PathLike[str] | None) -> bool:
    """Whether :func:`build_tokenizer` finds the byte-level BPE of ``text`` and ``vocab_size`` in ``cache_dir`` (it
    loads it instead of training one)."""
    return cache_dir is not None and _tokenizer_path(text, vocab_size, cache_dir).is_file()


def build_tokenizer(text: str, kind: str = "bpe", vocab_size: int = 4096,
                    cache_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """A tokenizer for ``text``.

    Args:
        text: the training text (BPE merges are learnt from it).
        kind: ``"bpe"`` (byte-level BPE, learnt in about a second for a few MB) or ``"bytes"`` (UTF-8 bytes).
        vocab_size: BPE vocabulary size (>= 257: the 256 byte symbols plus merges); ignored for ``"bytes"``.
            A small text may give fewer tokens; the returned ``vocab_size`` is the real one.
        cache_dir: folder to cache the trained BPE in, keyed by a hash of the text and the vocabulary size
            (see :func:`cache_dir_for`); ``None`` trains in memory without caching.

    Returns:
        an object with ``encode(str) -> list[int]``, ``decode(list[int]) -> str`` and ``vocab_size``.

    Raises:
        ValueError: an unknown ``kind`` or a ``vocab_size`` out of range.
    """
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"tokenizer kind must be 'bpe' or 'bytes', got {kind!r}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size <= 65535:
        raise ValueError(f"vocab_size must be an int in [257, 65535] for a byte-level BPE, got {vocab_size!r}")
    if not text:
        raise ValueError("cannot learn a BPE from empty text")
    path = None
    if cache_dir is not None:
        path = _tokenizer_path(text, vocab_size, cache_dir)
        if path.is_file():
            try:
                return BPETokenizer.from_json(path.read_text(encoding="utf-8"), path)
            except Exception:  # noqa: BLE001 - a corrupt cache is rebuilt
                pass
    tok = BPETokenizer.train(text, vocab_size)
    if path is not None:
        _atomic_write(path, tok.to_json().encode("utf-8"))
        tok.path = path
    return tok


def encode_corpus(text: str, tokenizer: Tokenizer, cache_dir: str | os.PathLike[str] | None = None
                  ) -> torch.Tensor:
    """All of ``text`` as a 1-D ``torch.long`` tensor of token ids.

    With ``cache_dir`` the ids are cached (``.npy``, keyed by the text and the tokenizer), which saves the
    encoding time (about a second for a few MB of BPE) on later runs.
    """
    fp = tokenizer.fingerprint() if hasattr(tokenizer, "fingerprint") else repr(tokenizer)
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"tokens-{_sha(f'v{CACHE_VERSION}', text, fp)}.npy"
        if path.is_file():
            try:
                return torch.from_numpy(np.load(path).astype(np.int64))
            except Exception:  # noqa: BLE001 - a corrupt cache is rebuilt
                pass
    if isinstance(tokenizer, ByteTokenizer):
        arr = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    elif hasattr(tokenizer, "encode_many"):
        arr = np.fromiter((i for ids in tokenizer.encode_many(_chunks(text)) for i in ids), dtype=np.int64)
    else:
        arr = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if path is not None:
        buf = io.BytesIO()
        np.save(buf, arr.astype(np.uint16 if tokenizer.vocab_size <= 65536 else np.int32))
        _atomic_write(path, buf.getvalue())
    return torch.from_numpy(arr)


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)``: the last ``val_fraction`` of ``tokens`` (a contiguous tail) is held out.

    Raises:
        ValueError: ``val_fraction`` not in (0, 1), or too few tokens to leave both parts non-empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n = int(tokens.numel())
    n_val = max(1, int(round(n * val_fraction)))
    if n - n_val < 1:
        raise ValueError(f"{n} tokens are too few to split off a validation tail")
    return tokens[: n - n_val], tokens[n - n_val:]


def sample_batch(tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``tokens``: inputs ``x`` and next-token targets ``y``, both
    ``[batch_size, block_size]`` long tensors.

    Raises:
        ValueError: ``tokens`` shorter than ``block_size + 1``.
    """
    n = int(tokens.numel())
    if n < block_size + 1:
        raise ValueError(f"{n} tokens are too few for windows of block_size={block_size} (+1 target); "
                         "use more text, a smaller block size or a smaller validation fraction")
    starts = torch.randint(0, n - block_size, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(block_size + 1)
    windows = tokens[idx]
    return windows[:, :-1].long(), windows[:, 1:].long()


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats per token) on ``val`` of a unigram model fit on ``train`` with add-one smoothing.

    The loss of the best model that ignores context (up to smoothing): the baseline a trained language model
    must beat. For real text it lies well below ``log(vocab_size)``, the loss of a uniform guess.
    """
    counts = torch.bincount(train.reshape(-1).long(), minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[val.reshape(-1).long()].mean())

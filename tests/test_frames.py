"""Wire frames: round trips, and every kind of bad input (truncated, flipped, random, foreign, forged, non-finite)
raises FrameError and nothing else; on 4 Gloo ranks a corrupting rank is rejected and the others keep training."""

from __future__ import annotations

import time
import zlib

import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fgdiloco.gossip.mix
from fgdiloco import BF16, Dense, FGDiLoCo, Int8, LowRank
from fgdiloco.factor import HEADER_SIZE, FrameError, decode_frame, encode_frame, layout_fingerprint
from fgdiloco.factor.frame import _CRC, _HEADER, FLAG_SHUFFLE, FLAG_ZSTD, TAG_SIZE, _shuffle, _unshuffle
from fgdiloco.testing import run_ranks

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _like() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(24, 16, generator=g) * 1e-2, torch.randn(16, generator=g), torch.randn(6, 2, 3, generator=g)]


LIKE = _like()
FP = layout_fingerprint((f"p{i}", t.shape, t.dtype) for i, t in enumerate(LIKE))
CODECS = {
    "dense": Dense,
    "bf16": BF16,
    "int8": lambda: Int8(block=32),
    "lowrank": lambda: LowRank(rank=2),
    "lowrank-fp32": lambda: LowRank(rank=2, quantize=None),
    "lowrank-bf16": lambda: LowRank(rank=2, quantize="bf16"),
}


def _frame(name: str, tensors=None, *, compress: bool = True, sender: int = 3, round: int = 7) -> bytes:
    codec = CODECS[name]()
    body, _ = codec.encode(LIKE if tensors is None else tensors, stateful=False)
    return encode_frame(codec, body, sender=sender, round=round, fingerprint=FP, compress=compress,
                        shuffle=codec.shuffle)


FRAMES = {name: _frame(name) for name in CODECS}


def _decode(name: str, data, **kw) -> list[torch.Tensor]:
    return decode_frame(data, CODECS[name](), LIKE, fingerprint=FP, sender=3, round=7, **kw)


def _reference(name: str) -> list[torch.Tensor]:
    return CODECS[name]().encode(LIKE, stateful=False)[1]


def _only_frame_error(name: str, data) -> list[torch.Tensor] | None:
    """Decode; FrameError -> None. Anything else escaping fails the test."""
    try:
        return _decode(name, data)
    except FrameError as e:
        assert str(e)
        return None


def _forge(frame: bytes, *, payload: bytes | None = None, **fields) -> bytes:
    """Rewrite header fields and/or the payload of a frame and recompute its CRC: a frame with a valid checksum
    that its sender never made (the CRC catches accidents, so forged frames test everything after it)."""
    names = ["magic", "version", "codec_id", "flags", "shuffle", "sender", "round", "fingerprint", "raw_len",
             "payload_len"]
    values = dict(zip(names, _HEADER.unpack(frame[: _HEADER.size])))
    if payload is None:
        payload = frame[HEADER_SIZE:]
    else:
        values["payload_len"] = len(payload)
    values.update(fields)
    head = _HEADER.pack(*(values[n] for n in names))
    return head + _CRC.pack(zlib.crc32(payload, zlib.crc32(head))) + payload


# ---------------------------------------------------------------- valid frames
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("compress", [True, False])
def test_a_valid_frame_decodes_to_what_the_sender_holds(name, compress):
    data = _frame(name, compress=compress)
    for a, b in zip(_decode(name, data), _reference(name)):
        assert torch.equal(a, b)
    # bytes-like inputs work too
    for a, b in zip(_decode(name, memoryview(bytearray(data))), _reference(name)):
        assert torch.equal(a, b)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 8))
def test_the_byte_plane_shuffle_is_the_transposed_layout_and_unshuffle_inverts_it(raw, itemsize):
    """The wire layout of a shuffled payload: byte k of every element for k = 0 .. itemsize - 1 (the transpose of
    the elements' bytes), then the bytes left over; unshuffle restores the input exactly, for any length."""
    import numpy as np

    n = len(raw) // itemsize * itemsize
    planes = np.frombuffer(raw[:n], dtype=np.uint8).reshape(-1, itemsize).T.tobytes()
    assert _shuffle(raw, itemsize) == planes + raw[n:]
    assert _unshuffle(_shuffle(raw, itemsize), itemsize) == raw


def test_frame_size_is_header_plus_payload_and_shuffle_pays_for_floats():
    g = torch.Generator().manual_seed(1)
    big = [torch.randn(256, 256, generator=g) * 1e-3]
    fp = layout_fingerprint([("w", (256, 256), torch.float32)])
    for codec in (Dense(), BF16()):
        body, _ = codec.encode(big)
        plain = encode_frame(codec, body, sender=0, round=0, fingerprint=fp)
        shuffled = encode_frame(codec, body, sender=0, round=0, fingerprint=fp, shuffle=codec.shuffle)
        assert len(shuffled) < len(plain) < len(body) + HEADER_SIZE
        raw = encode_frame(codec, body, sender=0, round=0, fingerprint=fp, compress=False)
        assert len(raw) == HEADER_SIZE + len(body)
        out = decode_frame(shuffled, codec, big, fingerprint=fp)
        assert torch.equal(out[0], codec.decode(body, big)[0])


# ---------------------------------------------------------------- accidents: truncation, bit flips, noise
@pytest.mark.parametrize("name", list(CODECS))
def test_every_truncation_and_extension_of_a_frame_is_rejected(name):
    data = FRAMES[name]
    for k in range(len(data)):
        with pytest.raises(FrameError):
            _decode(name, data[:k])
    for extra in (b"\0", b"\xff" * 9):
        with pytest.raises(FrameError, match="length"):
            _decode(name, data + extra)


@FUZZ
@given(name=st.sampled_from(list(CODECS)), data=st.data())
def test_random_bit_flips_are_rejected(name, data):
    frame = bytearray(FRAMES[name])
    assert len(frame) < 11_000  # CRC-32 detects every 1-3 bit error in messages this short (Hamming distance 4)
    positions = data.draw(st.lists(st.integers(0, 8 * len(frame) - 1), min_size=1, max_size=3, unique=True))
    for bit in positions:
        frame[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(FrameError):
        _decode(name, bytes(frame))


@FUZZ
@given(name=st.sampled_from(list(CODECS)), noise=st.binary(min_size=0, max_size=2000), keep_header=st.booleans())
def test_random_bytes_are_rejected(name, noise, keep_header):
    data = (FRAMES[name][:HEADER_SIZE] + noise) if keep_header else noise
    with pytest.raises(FrameError):
        _decode(name, data)


@pytest.mark.parametrize("bad", [None, "a frame", 12, [1, 2, 3]])
def test_non_bytes_are_rejected(bad):
    with pytest.raises(FrameError):
        _decode("dense", bad)


# ---------------------------------------------------------------- foreign frames
def test_a_frame_from_another_layout_is_rejected():
    other = [torch.randn(16, 24), torch.randn(16), torch.randn(6, 2, 3)]
    fp_other = layout_fingerprint((f"p{i}", t.shape, t.dtype) for i, t in enumerate(other))
    body, _ = Dense().encode(other)
    data = encode_frame(Dense(), body, sender=3, round=7, fingerprint=fp_other)
    with pytest.raises(FrameError, match="fingerprint"):
        _decode("dense", data)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("magic", b"FGDX", "magic"), ("version", 2, "version"), ("codec_id", 2, "codec"), ("codec_id", 200, "codec"),
    ("sender", 2, "sender"), ("round", 8, "round"), ("fingerprint", b"\0" * 8, "fingerprint"),
])
def test_a_frame_with_a_wrong_header_field_is_rejected(field, value, match):
    with pytest.raises(FrameError, match=match):
        _decode("dense", _forge(FRAMES["dense"], **{field: value}))


def test_a_frame_from_another_codec_is_rejected():
    with pytest.raises(FrameError, match="codec id"):
        _decode("bf16", FRAMES["dense"])
    # same codec id, another configuration: the body header and length tell
    with pytest.raises(FrameError):
        decode_frame(FRAMES["lowrank"], LowRank(rank=3), LIKE, fingerprint=FP)
    with pytest.raises(FrameError):
        decode_frame(FRAMES["lowrank"], LowRank(rank=2, block=64), LIKE, fingerprint=FP)
    with pytest.raises(FrameError):
        decode_frame(FRAMES["int8"], Int8(block=64), LIKE, fingerprint=FP)


# ---------------------------------------------------------------- non-finite tensors
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_tensor_is_rejected(name, bad):
    tensors = [t.clone() for t in LIKE]
    tensors[0][5, 5] = bad
    tensors[1][3] = bad
    with pytest.raises(FrameError, match="NaN or Inf"):
        _decode(name, _frame(name, tensors))


# ---------------------------------------------------------------- forged frames (valid CRC)
def test_a_zstd_bomb_is_rejected_before_it_is_decompressed():
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (256 << 20))  # 256 MiB of zeros in ~8 KiB
    t0 = time.perf_counter()
    for raw_len in (256 << 20, 1 << 40, (1 << 64) - 1):
        with pytest.raises(FrameError, match="announces"):
            _decode("dense", _forge(FRAMES["dense"], payload=bomb, raw_len=raw_len, flags=FLAG_ZSTD, shuffle=0))
    # the header tells the truth about the body size, the zstd frame lies
    expected = Dense().max_body_bytes(LIKE)
    with pytest.raises(FrameError, match="zstd frame announces"):
        _decode("dense", _forge(FRAMES["dense"], payload=bomb, raw_len=expected, flags=FLAG_ZSTD, shuffle=0))
    assert time.perf_counter() - t0 < 2.0


def _with_content_size(frame: bytes, size: int) -> bytes:
    """A zstd frame whose header announces ``size`` bytes (RFC 8878 §3.1.1.1: frame header descriptor, optional
    window descriptor and dictionary id, then the frame content size field)."""
    fhd = frame[4]
    fcs_flag, single = fhd >> 6, bool(fhd & 0x20)
    off = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    value = size - 256 if width == 2 else size
    assert width and 0 <= value < 1 << (8 * width)
    return frame[:off] + value.to_bytes(width, "little") + frame[off + width :]


def _zstd_variants(body: bytes) -> dict[str, bytes]:
    good = zstandard.ZstdCompressor(level=1).compress(body)
    no_size = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(body)
    shorter = zstandard.ZstdCompressor(level=1).compress(body[: len(body) // 2])
    assert zstandard.frame_content_size(_with_content_size(good, len(body) - 8)) == len(body) - 8
    out = {
        # the stream holds len(body) bytes but claims to hold fewer / more: zstd itself must stop
        "content size too small": _with_content_size(good, len(body) - 8),
        "content size too large, stream short": _with_content_size(shorter, len(body)),
        "no content size": no_size,
        "trailing bytes": good + b"junk",
        "two frames": good + good,
        "truncated stream": good[:-4],
        "not zstd": body,
        "empty": b"",
    }
    return out


@pytest.mark.parametrize("variant", ["no content size", "trailing bytes", "two frames", "truncated stream",
                                     "not zstd", "empty", "content size too small",
                                     "content size too large, stream short"])
def test_a_zstd_stream_that_is_not_one_frame_of_the_announced_size_is_rejected(variant):
    body, _ = Dense().encode(LIKE)
    payloads = _zstd_variants(body)
    with pytest.raises(FrameError):
        _decode("dense", _forge(FRAMES["dense"], payload=payloads[variant], raw_len=len(body), flags=FLAG_ZSTD,
                                shuffle=0))


def test_a_stream_longer_than_its_zstd_content_size_is_stopped_by_zstd():
    """Header and zstd frame agree on a length the stream exceeds: decompression stops at that size."""
    body, _ = Int8(block=32).encode(LIKE)
    good = zstandard.ZstdCompressor(level=1).compress(body + b"\0" * 64)
    lie = _with_content_size(good, len(body))
    with pytest.raises(FrameError, match="decompress"):
        _decode("int8", _forge(FRAMES["int8"], payload=lie, raw_len=len(body), flags=FLAG_ZSTD, shuffle=0))


@pytest.mark.parametrize(("fields", "match"), [
    ({"flags": FLAG_ZSTD | FLAG_SHUFFLE | 8}, "unknown flags"),
    ({"flags": FLAG_ZSTD, "shuffle": 4}, "disagree"),
    ({"flags": FLAG_ZSTD | FLAG_SHUFFLE, "shuffle": 0}, "disagree"),
    ({"raw_len": 12}, "zstd frame announces"),
])
def test_inconsistent_flags_and_lengths_are_rejected(fields, match):
    with pytest.raises(FrameError, match=match):
        _decode("dense", _forge(FRAMES["dense"], **fields))


@FUZZ
@given(name=st.sampled_from(list(CODECS)), data=st.data())
def test_forged_headers_never_give_wrong_tensors_or_other_errors(name, data):
    """Random header bytes (magic and CRC excluded) with a recomputed CRC: FrameError, or, where the change does
    not matter, exactly the sender's tensors."""
    frame = bytearray(FRAMES[name])
    edits = data.draw(st.lists(st.tuples(st.integers(4, _HEADER.size - 1), st.integers(0, 255)), min_size=1,
                               max_size=4))
    for pos, value in edits:
        frame[pos] = value
    forged = _forge(bytes(frame))
    got = _only_frame_error(name, forged)
    if got is not None:
        assert all(torch.equal(a, b) for a, b in zip(got, _reference(name)))


@FUZZ
@given(name=st.sampled_from(list(CODECS)), compress=st.booleans(), data=st.data())
def test_forged_payloads_raise_only_frame_error(name, compress, data):
    """A forged body of random bytes (valid CRC, right length) is whatever the forger sent: it must decode to
    finite tensors of the right shapes or raise FrameError, never anything else."""
    codec = CODECS[name]()
    n = codec.max_body_bytes(LIKE)
    size = data.draw(st.one_of(st.just(n), st.integers(0, n + 64)))
    body = data.draw(st.binary(min_size=size, max_size=size))
    payload = zstandard.ZstdCompressor(level=1).compress(body) if compress else body
    forged = _forge(FRAMES[name], payload=payload, raw_len=len(body),
                    flags=FLAG_ZSTD if compress else 0, shuffle=0)
    got = _only_frame_error(name, forged)
    if got is not None:
        assert [t.shape for t in got] == [t.shape for t in LIKE]
        assert all(bool(torch.isfinite(t).all()) for t in got)


# ---------------------------------------------------------------- authenticated frames (job secret)
SECRET = b"the job's secret"


def _signed(name: str, secret: bytes = SECRET, **kw) -> bytes:
    codec = CODECS[name]()
    body, _ = codec.encode(LIKE, stateful=False)
    return encode_frame(codec, body, sender=3, round=7, fingerprint=FP, shuffle=codec.shuffle, secret=secret, **kw)


@pytest.mark.parametrize("name", list(CODECS))
def test_an_authenticated_frame_decodes_with_the_secret_and_costs_32_bytes(name):
    frame = _signed(name)
    assert len(frame) == len(FRAMES[name]) + TAG_SIZE
    got = _decode(name, frame, secret=SECRET)
    assert all(torch.equal(a, b) for a, b in zip(got, _reference(name)))


@pytest.mark.parametrize(("make", "secret", "match"), [
    (lambda: _signed("dense", b"another secret"), SECRET, "authentication tag does not match"),
    (lambda: FRAMES["dense"], SECRET, "carries no authentication tag"),
    (lambda: _signed("dense"), None, "authenticated but this worker has no job secret"),
    # a forger without the secret rewrites the round (valid CRC) and keeps the old tag: the tag covers the header
    (lambda: _forge(_signed("dense")[:-TAG_SIZE], round=8) + _signed("dense")[-TAG_SIZE:], SECRET,
     "tag does not match"),
    (lambda: _signed("dense")[:-1] + bytes([_signed("dense")[-1] ^ 1]), SECRET, "tag does not match"),
    (lambda: _signed("dense")[:-TAG_SIZE], SECRET, "does not match its header"),
])
def test_frames_without_a_valid_tag_are_rejected(make, secret, match):
    with pytest.raises(FrameError, match=match):
        _decode("dense", make(), secret=secret)


def test_a_replayed_authenticated_frame_is_rejected_in_another_round():
    with pytest.raises(FrameError, match="belongs to round 7, expected 8"):
        decode_frame(_signed("dense"), Dense(), LIKE, fingerprint=FP, sender=3, round=8, secret=SECRET)


@FUZZ
@given(data=st.data())
def test_bit_flips_in_an_authenticated_frame_raise_only_frame_error(data):
    frame = bytearray(_signed("int8"))
    for pos in data.draw(st.lists(st.integers(0, len(frame) - 1), min_size=1, max_size=3, unique=True)):
        frame[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(FrameError):
        _decode("int8", bytes(frame), secret=SECRET)


# ---------------------------------------------------------------- 4 Gloo ranks, one of them corrupts its frames
_TEACHER = torch.linspace(-1.0, 1.0, 32).unsqueeze(1) / 4


def _corrupt_run(rank: int, world: int, bad_rank: int) -> dict:
    if rank == bad_rank:
        real = fgdiloco.gossip.mix.encode_frame

        def corrupting(*args, **kwargs):
            frame = bytearray(real(*args, **kwargs))
            frame[-1] ^= 0x40  # one bit of the payload: the CRC catches it
            return bytes(frame)

        fgdiloco.gossip.mix.encode_frame = corrupting  # this forked rank only
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1))
    # outer momentum 0.5: on this easy task DiLoCo's 0.9 overshoots and the loss oscillates between rounds
    opt = FGDiLoCo(model, torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=5, outer_momentum=0.5,
                   codec=LowRank(rank=2), topology="random", timeout=20.0)
    x_eval = torch.randn(256, 32, generator=torch.Generator().manual_seed(12345))

    def eval_loss() -> float:
        with torch.no_grad():
            return float(((model(x_eval) - x_eval @ _TEACHER) ** 2).mean())

    first, errors = eval_loss(), []
    for step in range(60):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(7919 * rank + step))
        ((model(x) - x @ _TEACHER) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % 5 == 0:
            errors += opt.last_round.errors
    opt.close()
    return {"first": first, "last": eval_loss(), "failed": opt.failed_exchanges_total, "errors": errors,
            "rounds": opt.round, "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def test_frames_from_a_corrupting_rank_are_rejected_and_the_others_keep_training(tmp_path):
    bad = 1
    results = run_ranks(_corrupt_run, 4, tmp_path, bad)
    rounds = results[0]["rounds"]
    assert rounds == 12
    # every gossip round (Mix1 and Mix2, one each per outer round) pairs the bad rank with exactly one peer
    rejected = sum(r["failed"] for i, r in enumerate(results) if i != bad)
    assert rejected == 2 * rounds
    # it receives good frames, but its peers reject its own: an exchange is applied by both sides or by neither
    assert results[bad]["failed"] == 2 * rounds
    for i, r in enumerate(results):
        assert r["finite"]
        assert r["last"] < 0.1 * r["first"], (i, r["first"], r["last"])
        if i != bad:
            assert all(f"rejected frame from rank {bad}" in e and "checksum" in e for e in r["errors"])


def test_a_forged_shuffle_element_size_is_rejected():
    """hypothesis found it: a dense frame whose shuffle size (header byte 7) says 207 decoded to other values"""
    with pytest.raises(FrameError, match="frame shuffles 207-byte elements; dense frames shuffle 4 or none"):
        _decode("dense", _forge(FRAMES["dense"], shuffle=207))

"""The versioned weight push (``aligner.generation.weight_push``): its buckets, checksum and
headers in one process; then one launch of two gloo processes (tests/workers/weight_push.py)
in which rank 0 pushes a tiny policy's weight stream and rank 1 receives it into an engine's
owned weights and a policy module: good versions arrive bit for bit, faulty, stale and
mismatched ones are refused with nothing swapped, and a sender that stops mid-push ends the
receiver's wait with the group's timeout."""

from __future__ import annotations

import pytest
import torch
from _torchrun import run_worker

from aligner.generation.weight_push import (
    ALIGN,
    PushFault,
    WeightPushError,
    _checksum,
    _decode_header,
    _encode_header,
    _pack,
    _unpack,
    checksum,
    plan_buckets,
)


def _stream(sizes: list[int], pulled: list[int] | None = None):
    for i, n in enumerate(sizes):
        if pulled is not None:
            pulled.append(i)
        yield f"t{i}", torch.zeros(n, dtype=torch.uint8)


def test_buckets_hold_at_most_their_bytes_and_mark_the_last():
    sizes = [10, 20, 100, 5, 5, 64]
    got = list(plan_buckets(_stream(sizes), 48))
    # Each size rounds up to ALIGN (16): 16, 32 | 112 (alone, larger) | 16, 16 | 64 (alone).
    assert [[n for n, _ in b] for b, _ in got] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert [last for _, last in got] == [False, False, False, True]
    assert [[n for n, _ in b] for b, _ in plan_buckets(_stream(sizes), 1 << 20)] == [
        [f"t{i}" for i in range(6)]
    ]
    assert list(plan_buckets(_stream([]), 64)) == []


def test_buckets_pull_the_stream_one_tensor_ahead():
    pulled: list[int] = []
    it = plan_buckets(_stream([16, 16, 16, 16], pulled), 16)
    next(it)
    assert pulled == [0, 1]  # bucket 0 is known not to be the last once tensor 1 is in
    assert len(list(it)) == 3 and pulled == [0, 1, 2, 3]


def test_buckets_close_when_the_header_would_overflow():
    names = [(f"decoder.layers.{i}.a_rather_long_tensor_name.weight", torch.zeros(1)) for i in range(400)]
    got = list(plan_buckets(iter(names), 1 << 30, header_bytes=8192))
    assert len(got) > 1 and sum(len(b) for b, _ in got) == 400
    for b, last in got:
        header = {"format": 1, "version": 1, "bucket": 0, "final": last, "nbytes": 0, "checksum": [0, 0]}
        _encode_header(header | {"tensors": _pack(b, torch.device("cpu"))[1]}, 8192, torch.device("cpu"))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(plan_buckets(iter(names), 0))


def test_pack_and_unpack_keep_every_dtype_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    items = [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.randint(-9, 9, (2, 3), generator=g)),
        ("d", torch.randn(1, generator=g).to(torch.float16)),
        ("e", torch.tensor([True, False, True])),
        ("f", torch.randn(4, 2, generator=g).t()),  # not contiguous
        ("g", torch.zeros(0, 3)),
    ]
    payload, entries = _pack(items, torch.device("cpu"))
    assert payload.numel() % ALIGN == 0 and all(e[3] % ALIGN == 0 for e in entries)
    back = _unpack(payload, entries)
    assert [n for n, _ in back] == [n for n, _ in items]
    for (_, t), (_, u) in zip(items, back, strict=True):
        assert u.dtype == t.dtype and u.shape == t.shape and torch.equal(u, t)
    with pytest.raises(ValueError, match="runs past"):
        _unpack(payload[:-ALIGN], entries)
    with pytest.raises(ValueError, match="malformed"):
        _unpack(payload, [["a", "float32", [3, 5], 3]])  # unaligned


def test_checksum_catches_any_byte_flip_and_any_word_swap():
    g = torch.Generator().manual_seed(1)
    payload = torch.randint(0, 256, (256,), dtype=torch.uint8, generator=g)
    ref = checksum(payload)
    for i in range(payload.numel()):
        bad = payload.clone()
        bad[i] ^= 1 << (i % 8)
        assert checksum(bad) != ref, i
    words = payload.view(torch.int64)
    for i, j in [(0, 1), (0, 31), (5, 20)]:
        swapped = words.clone()
        swapped[[i, j]] = swapped[[j, i]]
        assert checksum(swapped.view(torch.uint8)) != ref
    # What it is: a word sum and a position-weighted one, modulo 2**64 (as signed int64).
    w = words.tolist()
    s1, s2 = sum(w), sum((k + 1) * x for k, x in enumerate(w))
    assert ref == tuple((s + 2**63) % 2**64 - 2**63 for s in (s1, s2))


def test_checksum_is_the_same_across_its_chunks(monkeypatch):
    import aligner.generation.weight_push as wp

    payload = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    whole = _checksum(payload).tolist()
    monkeypatch.setattr(wp, "_CPU_CHUNK", 100)
    assert _checksum(payload).tolist() == whole


def test_a_header_round_trips_and_a_flipped_byte_is_found():
    h = _encode_header({"format": 1, "version": 3, "final": True}, 256, torch.device("cpu"))
    assert h.numel() == 256 and _decode_header(h)["version"] == 3
    h[12] ^= 1
    with pytest.raises(ValueError, match="CRC-32"):
        _decode_header(h)
    with pytest.raises(WeightPushError, match="does not fit"):
        _encode_header({"format": 1, "x": "y" * 300}, 256, torch.device("cpu"))
    with pytest.raises(ValueError, match="expected a kind"):
        PushFault("melt")


@pytest.fixture(scope="module")
def pushed():
    return run_worker("weight_push.py", timeout=180)


def _pairs(pushed):
    return list(zip(pushed["sender"], pushed["receiver"], strict=False))


def _refused(pushed, i: int, text: str) -> dict:
    """Push ``i`` was refused by the receiver with ``text`` in its error, and the sender heard of
    it; the receiver's report."""
    s, r = _pairs(pushed)[i]
    assert text in r["error"], r["error"]
    assert s["refused"] == 1
    return r


@pytest.mark.multiprocess
def test_good_versions_arrive_bit_for_bit_in_buckets_of_every_size(pushed):
    sender, receiver = pushed["sender"], pushed["receiver"]
    for i, buckets in [(0, 15), (1, 10), (2, 1), (4, 15), (10, 10)]:
        s, r = sender[i], receiver[i]
        assert "error" not in r, r["error"]
        assert s["buckets"] == buckets and s["tensors"] == 15 and s["refused"] == 0
        assert s["bytes"] == 111232 and s["gbps"] > 0  # timed and reported
        assert r["owned"] == s["sent"] and r["module"] == s["sent"]
        if "received" in r:
            assert r["received"] == s["sent"]
    assert [receiver[i]["version"] for i in (0, 1, 2, 4, 10)] == [1, 2, 3, 4, 5]
    assert len({str(sender[i]["sent"]) for i in range(3)}) == 3  # three different versions


@pytest.mark.multiprocess
def test_a_corrupted_bucket_is_refused_naming_it_and_nothing_is_swapped(pushed):
    s, r = _pairs(pushed)[3]
    assert "version 4, bucket 1: checksum" in r["error"] and "nothing was swapped" in r["error"]
    assert s["refused"] == 1 and r["last_version"] == 3
    v3 = pushed["sender"][2]["sent"]
    assert r["owned"] == v3 and r["module"] == v3  # still version 3's, bit for bit
    nxt = pushed["receiver"][4]
    assert nxt["version"] == 4 and nxt["owned"] == pushed["sender"][4]["sent"]


@pytest.mark.multiprocess
def test_an_older_or_equal_version_is_refused(pushed):
    v4 = pushed["sender"][4]["sent"]
    for i, text in [
        (5, "version 4 is not newer than version 4"),
        (6, "version 2 is not newer than version 4"),
        (11, "version 6 is not newer than version 9"),  # expect_after=9
    ]:
        r = _refused(pushed, i, text)
        if i in (5, 6):
            assert r["owned"] == v4 and r["last_version"] == 4


@pytest.mark.multiprocess
def test_a_header_or_manifest_that_does_not_match_is_refused(pushed):
    v4 = pushed["sender"][4]["sent"]
    for i, text in [
        (7, "version 5, bucket 2: the header names version 6"),
        (8, "version 5: the manifest"),
        (9, "version 5, bucket 1: bucket 2 came where bucket 1 was expected"),
    ]:
        r = _refused(pushed, i, text)
        assert r["owned"] == v4 and r["module"] == v4


@pytest.mark.multiprocess
def test_a_bucket_that_never_comes_ends_with_the_groups_timeout(pushed):
    s, r = _pairs(pushed)[12]
    assert s["refused"] is None  # the sender stopped: no ack
    assert "version 7, bucket 1: no bucket came" in r["error"] and "Timed out" in r["error"]
    assert 2.5 < r["seconds"] < 30
    v5 = pushed["sender"][10]["sent"]
    assert r["owned"] == v5 and r["last_version"] == 5
    after = pushed["receiver"][13]  # the group is out of step: refused at once
    assert "out of step since version 7, bucket 1 never came" in after["error"] and after["seconds"] < 1

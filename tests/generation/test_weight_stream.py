"""The weight stream (``aligner.models.layout``): its buckets, and the stream of one set of
weights under TP=2, PP=2 and TP=2 x PP=2 against TP=1.

``tests/models/test_hf_convert_tp.py`` imports HF models at TP=2 and at PP=2 and checks their exports
against transformers; here the same weights are loaded into every layout with
``load_megatron_tensors`` and the HF stream (``iter_hf_tensors``) of each layout must be the
TP=1 stream name for name and bit for bit, for three architectures (GQA with a padded
vocabulary and an untied head; q/k/v biases with tied embeddings; GPT-2's LayerNorm, learned
positions and biases), and the export written at TP=2 x PP=2 must give transformers the TP=1
logits. One launch of four gloo processes runs every layout (the parallel state is torn down
and set up again between them).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import transformers
from _layout_workers import TOKENS, stream_worker
from safetensors.torch import load_file

from aligner import distributed
from aligner.models.layout import bucketed


def _stream(sizes: list[int], pulled: list[int] | None = None):
    for i, n in enumerate(sizes):
        if pulled is not None:
            pulled.append(i)
        yield f"t{i}", torch.zeros(n, dtype=torch.float32)  # 4 bytes per element


def _names(buckets) -> list[list[str]]:
    return [[name for name, _ in b] for b in buckets]


def test_bucketed_groups_in_order_under_the_limit():
    # 4-byte elements: sizes 40, 40, 80, 200, 8, 8 bytes.
    sizes = [10, 10, 20, 50, 2, 2]
    got = list(bucketed(_stream(sizes), 100))
    assert _names(got) == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]  # t3 (200 B) alone
    for b in got:
        assert sum(t.numel() * 4 for _, t in b) <= 100 or len(b) == 1
    assert _names(bucketed(_stream(sizes), 80)) == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert _names(bucketed(_stream(sizes), 1)) == [[f"t{i}"] for i in range(6)]
    for everything in (None, 0):
        assert _names(bucketed(_stream(sizes), everything)) == [[f"t{i}" for i in range(6)]]
    assert list(bucketed(_stream([]), 100)) == []


def test_bucketed_pulls_the_stream_lazily():
    """A bucket is handed out as soon as the next tensor would overflow it: the stream is
    pulled one tensor ahead, never further, so a consumer holds at most one bucket and one
    tensor of a model at a time."""
    pulled: list[int] = []
    it = bucketed(_stream([10, 10, 20, 50, 2], pulled), 80)
    assert pulled == []
    assert _names([next(it)]) == [["t0", "t1"]] and pulled == [0, 1, 2]
    assert _names([next(it)]) == [["t2"]] and pulled == [0, 1, 2, 3]
    assert _names(list(it)) == [["t3"], ["t4"]] and pulled == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_bucketed_names_a_bad_limit(bad):
    with pytest.raises(ValueError, match=r"max_bytes=.*expected an integer >= 0, or None"):
        list(bucketed(_stream([1]), bad))


@pytest.mark.multiprocess
def test_stream_at_tp2_pp2_and_tp2xpp2_equals_tp1(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    transformers.logging.set_verbosity_error()
    # join=True: a worker that raises fails the test (the others are terminated).
    mp.spawn(stream_worker, args=(4, distributed.free_port(), str(tmp_path)), nprocs=4, join=True)

    expected = load_file(str(tmp_path / "tp1_logits.safetensors"))["logits"]
    hf = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf_tp2pp2", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = hf(torch.tensor(TOKENS)).logits
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)

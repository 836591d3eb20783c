"""The TensorRT-LLM engine's package boundary, configuration and container recipe, against the
test double of TensorRT-LLM's LLM API (tests/_trtllm_fakes.py).

The boundary: importing the adapter does not import ``tensorrt_llm``; a missing package is named
with what it needs and the recipe; only the targeted release line loads; the double itself rejects
misspelled keywords and wrong types. The configuration: every bad field named, the HF config folder
the engine is built from, the architecture served, the generation TP group (two gloo processes
refitting one engine from both GPUs' handles), ``max_seq_len`` and the banned ids.
``Dockerfile.trtllm`` is checked against the targeted release and the project's pins.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from _trtllm_fakes import (
    API,
    PROMPTS,
    SMALL,
    TOK,
    WIDE,
    FakeKvCacheConfig,
    FakeLLM,
    FakeSamplingParams,
    _engine,
    _fake_gpu,  # noqa: F401  (an autouse fixture)
    _world,  # noqa: F401  (an autouse fixture)
)

from aligner import distributed
from aligner.generation import trtllm
from aligner.generation.engine import SamplingParams
from aligner.generation.trtllm import TrtllmConfig, TrtllmEngine
from aligner.generation.trtllm import engine as trtllm_engine
from aligner.generation.trtllm.handles import default_architecture
from aligner.models import gpt
from aligner.models.config import ModelConfig
from aligner.models.hf import iter_hf_tensors

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# The package boundary
# ----------------------------------------------------------------------------------------------


def test_importing_the_module_does_not_import_tensorrt_llm():
    """In a fresh interpreter, where the package may be installed (NVIDIA's container) or not."""
    code = "import sys, aligner.generation.trtllm; print('tensorrt_llm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_missing_package_names_the_package_its_needs_and_the_recipe(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # "import tensorrt_llm" raises ImportError
    with pytest.raises(ImportError) as err:
        trtllm.load_llm_api()
    assert isinstance(err.value, trtllm.TrtllmUnavailableError)
    msg = str(err.value)
    for part in (
        "tensorrt_llm",
        trtllm.TRTLLM_VERSION,
        "CUDA",
        "3.10",
        "3.12",
        "Dockerfile.trtllm",
        trtllm.TRTLLM_IMAGE,
    ):
        assert part in msg, part
    with pytest.raises(trtllm.TrtllmUnavailableError):  # the engine's default factory
        TrtllmEngine(SMALL, pad_id=TOK.pad_id, eos_id=TOK.eos_id, workdir=tmp_path)


def _fake_package(monkeypatch, version: str) -> None:
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__version__ = version
    pkg.LLM = FakeLLM
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig, llmapi.SamplingParams = FakeKvCacheConfig, FakeSamplingParams
    pkg.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)


@pytest.mark.parametrize("version", ["1.2.1", "1.2.0", "1.2.0rc6"])
def test_the_targeted_release_line_loads(monkeypatch, version):
    _fake_package(monkeypatch, version)
    assert trtllm.load_llm_api() == API


@pytest.mark.parametrize("version", ["1.1.0", "1.3.0rc13", "0.21.0"])
def test_another_release_line_is_refused_naming_both(monkeypatch, version):
    _fake_package(monkeypatch, version)
    with pytest.raises(trtllm.TrtllmUnavailableError, match=re.escape(version)) as err:
        trtllm.load_llm_api()
    assert trtllm.TRTLLM_VERSION in str(err.value)


def test_the_double_rejects_misspelled_keywords_and_wrong_types(tmp_path):
    with pytest.raises(TypeError, match="max_token"):
        FakeSamplingParams(max_token=4)
    with pytest.raises(TypeError, match="temperature"):
        FakeSamplingParams(temperature=1)  # an int where the API documents a float
    with pytest.raises(TypeError, match="top_k"):
        FakeSamplingParams(top_k=True)
    with pytest.raises(TypeError, match="enable_block_reuse"):
        FakeKvCacheConfig(enable_block_reuse=1)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    with pytest.raises(TypeError, match="enable_sleeps"):
        FakeLLM(model=str(tmp_path), enable_sleeps=True)
    with pytest.raises(TypeError, match="load_format"):
        FakeLLM(model=str(tmp_path), load_format="dumy")


# ----------------------------------------------------------------------------------------------
# Configuration and the HF folder
# ----------------------------------------------------------------------------------------------


def test_config_problems_name_every_bad_field(tmp_path):
    assert TrtllmConfig().problems() == []
    bad = TrtllmConfig(
        hf_config_dir=str(tmp_path / "absent"),
        architecture="LlamaForSequenceClassification",
        dtype="fp8",
        free_gpu_memory_fraction=0.0,
        max_batch_size=0,
        max_num_tokens=2.5,
        bucket_mb=-1,
        sleep_during_training="yes",
    )
    p = bad.problems("generation.trtllm")
    keys = [m.split("=")[0] for m in p]
    assert keys == [
        "generation.trtllm.hf_config_dir",
        "generation.trtllm.architecture",
        "generation.trtllm.dtype",
        "generation.trtllm.free_gpu_memory_fraction",
        "generation.trtllm.max_batch_size",
        "generation.trtllm.max_num_tokens",
        "generation.trtllm.bucket_mb",
        "generation.trtllm.sleep_during_training",
    ]
    assert "'fp8': expected one of ['bfloat16', 'float16', 'float32']" in p[2]
    with pytest.raises(ValueError, match="8 problem"):
        TrtllmEngine(SMALL, pad_id=13, eos_id=0, config=bad, workdir=tmp_path, llm_factory=lambda: API)


def test_the_engine_is_built_from_an_hf_config_folder_of_the_policy(tmp_path):
    from aligner.models.hf_config import hf_architecture, model_config_from_hf
    from aligner.models.layout import weight_layout_diff

    _engine(tmp_path, WIDE)
    folder = Path(FakeLLM.instances[-1].args["model"])
    assert folder == tmp_path / "trtllm_hf_config" and sorted(p.name for p in folder.iterdir()) == [
        "config.json"
    ]
    assert hf_architecture(folder) == "LlamaForCausalLM"
    assert weight_layout_diff(WIDE, model_config_from_hf(folder), "lm") == []
    # A given folder is used as it is, after checking that it describes the policy.
    eng = _engine(tmp_path / "x", WIDE, hf_config_dir=str(folder))
    assert FakeLLM.instances[-1].args["model"] == str(folder) and eng.arch == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="does not describe the policy"):
        _engine(tmp_path / "y", SMALL, hf_config_dir=str(folder))
    with pytest.raises(ValueError, match="workdir"):
        TrtllmEngine(SMALL, pad_id=13, eos_id=0, llm_factory=lambda: API)


def test_qwen2_shaped_policies_are_served_as_qwen2():
    cfg = ModelConfig(add_qkv_bias=True, vocab_size=14)
    assert default_architecture(cfg) == "Qwen2ForCausalLM"
    assert default_architecture(SMALL) == "LlamaForCausalLM"
    assert default_architecture(dataclasses.replace(SMALL, qk_layernorm=True)) == "Qwen3ForCausalLM"


def test_generation_tp_needs_a_group_of_that_size(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 but the engine group has 1"):
        TrtllmEngine(
            SMALL, pad_id=13, eos_id=0, tensor_parallel_size=2, workdir=tmp_path, llm_factory=lambda: API
        )


def test_max_seq_len_stays_within_the_policy_positions(tmp_path):
    with pytest.raises(ValueError, match="max_seq_len=25"):
        _engine(tmp_path, max_seq_len=SMALL.max_seq_len + 1)


def test_bad_token_ids_come_from_the_sampled_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="eos_id=12"):
        TrtllmEngine(
            SMALL, pad_id=13, eos_id=12, sample_vocab_size=12, workdir=tmp_path, llm_factory=lambda: API
        )
    eng = _engine(tmp_path)
    assert eng.banned_ids == [TOK.pad_id]


def _tp2_worker(rank: int, port: int, workdir: str) -> None:
    """Training TP 2 on two gloo processes, one engine of generation TP 2 owned by TP rank 0."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    uuids = ("GPU-rank0", "GPU-rank1")
    trtllm_engine.local_device_uuid = lambda: uuids[dist.get_rank()]  # each rank "is" its own GPU
    FakeLLM.DEVICE_UUIDS = uuids
    try:
        ps = distributed.initialize(distributed.ParallelConfig(tensor_model_parallel_size=2), seed=5)
        policy = gpt.build_policy(WIDE)
        eng = TrtllmEngine(
            WIDE,
            pad_id=1,
            eos_id=0,
            dp_rank=ps.dp_rank,
            tensor_parallel_size=2,
            group=ps.tp_group,
            config=TrtllmConfig(bucket_mb=1),
            workdir=workdir,
            llm_factory=lambda: API,
        )
        assert eng.is_owner == (ps.tp_rank == 0) and len(FakeLLM.instances) == (ps.tp_rank == 0)
        eng.refit(policy)
        expected = {
            n: t.clone() for n, t in iter_hf_tensors(policy, WIDE, "LlamaForCausalLM", dtype=torch.bfloat16)
        }
        if eng.is_owner:
            llm = FakeLLM.instances[-1]
            # Both GPUs' handles arrived (the double rebuilt each and found them equal).
            assert list(llm.weights) == list(expected) and len(llm.buckets) > 2
            for n, t in expected.items():
                assert torch.equal(llm.weights[n], t), n
            assert llm.events[-1] == ("finalize", None)
        out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=9))
        for t in (out.tokens, out.lengths, out.prompt_lengths, out.logprobs, out.ended.long()):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
            assert torch.equal(parts[0], parts[1]), "the engine group's ranks got different outputs"
        eng.close()
    finally:
        distributed.destroy()


@pytest.mark.multiprocess
def test_an_engine_group_of_two_ranks_refits_from_both_gpus_and_shares_its_output(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_tp2_worker, args=(distributed.free_port(), str(tmp_path)), nprocs=2, join=True)


# ----------------------------------------------------------------------------------------------
# The container recipe
# ----------------------------------------------------------------------------------------------


def _instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        buf += (" " if buf else "") + s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def test_the_recipe_builds_on_the_targeted_release_image_and_installs_the_project():
    steps = _instructions((ROOT / "Dockerfile.trtllm").read_text())
    args = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    froms = [rest for word, rest in steps if word == "FROM"]
    assert len(froms) == 1
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], froms[0].split()[0])
    assert image == trtllm.TRTLLM_IMAGE
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    copies = [rest for word, rest in steps if word == "COPY"]
    assert "pip install --no-deps ." in runs
    assert any(c.split()[0] == "aligner" for c in copies) and any("pyproject.toml" in c for c in copies)
    # The dependencies it adds are the project's own pins, its extras' included (never a second
    # torch or transformers, which the image's TensorRT-LLM is built against), plus Ray for the
    # orchestrator.
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]  # the plot and the tests run in the image too
    deps = project["dependencies"] + extras["plot"] + extras["dev"]
    pins = {re.split(r"[<>=\[; ]", d)[0].lower(): d.split(";")[0].strip() for d in deps}
    installed = re.findall(r'"([A-Za-z0-9_.\-\[\],]+(?:[<>=!~]=?[^"]*)?)"', runs)
    assert installed, runs
    for spec in installed:
        name = re.split(r"[<>=!~\[]", spec)[0].lower()
        assert name not in ("torch", "transformers"), spec
        assert name == "ray" or spec == pins.get(name), (spec, pins.get(name))
    assert "constraint" in runs  # the image's own torch/transformers/numpy are held in place

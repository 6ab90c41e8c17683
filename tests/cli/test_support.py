"""What each backend can run and with which engine: torch_backend.support and
ms_llm.mindspore.support, asked through ms_llm.backends and `ms-llm plan --backend`. Every
refusal names its field; the plans the end-to-end tests train (the torch matrix, the ZeRO
engine tests, the MindSpore CPU runs) are accepted, with the engine those tests exercise."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ms_llm import backends
from ms_llm.errors import StrategyError
from ms_llm.job import job_from_dict, load_job
from ms_llm.machine import DEVICE_ACCELERATORS, Machine
from ms_llm.mindspore import support as ms_support
from ms_llm.strategy.devices import DEVICES, get_device
from ms_llm.strategy.plan import plan as make_plan
from torch_backend import support as torch_support

sys.path.insert(0, str(Path(__file__).parent))
from torch_matrix_worker import CASES as TORCH_MATRIX, job_for  # noqa: E402
from zero_cases import MODEL as ZERO_MODEL, strategy_for, train_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA, ASCEND = Machine("cpu"), Machine("cuda"), Machine("ascend")
MODEL = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             max_seq_len=16, dtype="float32")
FP32 = {"param_dtype": "float32", "compute_dtype": "float32"}
MOE4 = {"moe": {"num_experts": 4, "capacity_factor": 1.25}}
MOE_MODEL = {**MODEL, **MOE4}
FP16 = {"param_dtype": "float32", "compute_dtype": "float16", "loss_scale": "dynamic"}
FIELD = re.compile(r"^(strategy|model|train)(\.\w+)*: ")


def plan_for(strategy: dict, world: int, model: dict = MODEL, **train):
    job = job_from_dict({"model": model, "strategy": strategy,
                         "train": {"global_batch_size": 8, "seq_len": 16, **train}})
    return make_plan(job.model, job.strategy, job.train, world)


def refused(support, plan, machine, match: str) -> list[str]:
    problems = support.refusals(plan, machine)
    assert any(re.search(match, p) for p in problems), problems
    assert all(FIELD.match(p) for p in problems), problems
    with pytest.raises(StrategyError, match=match):
        support.check(plan, machine)
    return problems


# (id, strategy, world, model overrides, message)
TORCH_REFUSALS = [
    ("moe-native", {"dp": 2, "ep": 2, "zero": {"engine": "native"}}, 2, MOE4,
     r"^strategy\.zero\.engine: MoE experts .*use engine shared"),
    ("moe-sp", {"tp": 2, "sequence_parallel": True}, 2, MOE4,
     r"^strategy\.sequence_parallel: .*sequence_parallel: false with model\.moe"),
    ("tied-tp", {"tp": 2}, 2, {"tie_embeddings": True}, r"^model\.tie_embeddings: .*untie it or use tp: 1"),
    ("offload-params", {"dp": 2, "zero": {"stage": 3}, "offload": {"params": True}}, 2, {},
     r"^strategy\.offload\.params: .*set it false"),
    ("offload-native", {"dp": 2, "zero": {"stage": 2, "engine": "native"}, "offload": {"optimizer": True}}, 2, {},
     r"^strategy\.offload\.optimizer: .*'fsdp2'.*engine: shared"),
    ("master-bf16", {"precision": {"param_dtype": "bfloat16", "master_dtype": "bfloat16"}}, 1, {},
     r"^strategy\.precision\.master_dtype: .*set float32"),
    ("hsdp-native-low-stage", {"dp": 4, "zero": {"stage": 1, "shard_size": 2, "engine": "native"}}, 4, {},
     r"^strategy\.zero\.shard_size: hybrid sharding below stage 3 needs engine 'shared'"),
    ("native-zero1-pp", {"dp": 2, "pp": 2, "zero": {"stage": 1, "engine": "native"}}, 4, {},
     r"^strategy\.zero\.engine: torch's native stage-1 optimizer does not compose with pipeline"),
    ("native-zero1-tp", {"dp": 2, "tp": 2, "zero": {"stage": 1, "engine": "native"}}, 4, {},
     r"^strategy\.zero\.stage: .*tensor-parallel parameters; use stage 2/3"),
    ("shared-zero-bubble", {"dp": 2, "pp": 2, "zero": {"engine": "shared"}, "pipeline": {"schedule": "zero_bubble"}},
     4, {}, r"^strategy\.pipeline\.schedule: .*engine: native"),
    ("ddp-bf16-reduce", {"dp": 2, "zero": {"engine": "native"}, "precision": {"grad_reduce_dtype": "bfloat16"}}, 2,
     {}, r"^strategy\.precision\.grad_reduce_dtype: .*use float32"),
]


@pytest.mark.parametrize("case", TORCH_REFUSALS, ids=[c[0] for c in TORCH_REFUSALS])
@pytest.mark.parametrize("machine", [CPU, CUDA], ids=["cpu", "cuda"])
def test_torch_refusals_name_the_field(case, machine):
    _, strategy, world, model, message = case
    refused(torch_support, plan_for(strategy, world, {**MODEL, **model}), machine, message)


def test_torch_accepts_float16_with_dynamic_scaling_and_offload_through_the_shared_engine():
    for strategy, world in [({"dp": 2, "precision": FP16}, 2),
                            ({"precision": {"param_dtype": "float16", "compute_dtype": "float16",
                                            "loss_scale": "dynamic"}}, 1),
                            ({"dp": 2, "zero": {"stage": 2}, "offload": {"optimizer": True}}, 2),
                            ({"dp": 4, "zero": {"stage": 1, "shard_size": 2}}, 4),           # HSDP, shared
                            ({"dp": 2, "pp": 2, "zero": {"stage": 1}}, 4)]:
        assert torch_support.refusals(plan_for(strategy, world), CPU) == [], strategy


@pytest.mark.parametrize("strategy,world,engine", [
    ({}, 1, "none"),
    ({"dp": 2}, 2, "shared"),                                            # auto: the shared engine
    ({"dp": 2, "zero": {"stage": 3}}, 2, "shared"),
    ({"dp": 2, "zero": {"engine": "native"}}, 2, "ddp"),
    ({"dp": 2, "zero": {"stage": 1, "engine": "native"}}, 2, "ddp+zero_redundancy_optimizer"),
    ({"dp": 2, "zero": {"stage": 2, "engine": "native"}}, 2, "fsdp2"),
    ({"dp": 4, "zero": {"stage": 3, "shard_size": 2, "engine": "native"}}, 4, "fsdp2"),   # HSDP
    ({"dp": 2, "tp": 2}, 4, "shared"),                                   # TP: the engine takes local shards
    ({"dp": 2, "tp": 2, "zero": {"stage": 3, "engine": "native"}}, 4, "fsdp2"),
    ({"dp": 2, "tp": 2, "zero": {"engine": "native"}}, 4, "replicate"),
    ({"dp": 2, "pp": 2, "pipeline": {"schedule": "zero_bubble"}}, 4, "replicate"),
    ({"dp": 2, "pp": 2}, 4, "shared"),
])
def test_torch_engine_choice(strategy, world, engine):
    assert torch_support.zero_engine(plan_for(strategy, world), CPU) == engine
    assert engine in torch_support.ENGINES


def test_torch_engine_refusal_is_raised_by_zero_engine():
    p = plan_for({"dp": 2, "pp": 2, "zero": {"engine": "shared"}, "pipeline": {"schedule": "zero_bubble"}}, 4)
    with pytest.raises(StrategyError, match="strategy.pipeline.schedule.*engine: native"):
        torch_support.zero_engine(p, CPU)


# (id, strategy, world, model overrides, machines that refuse, message)
MS_REFUSALS = [
    ("tp", {"tp": 2, "precision": FP32}, 2, {}, [CPU, CUDA],
     r"^strategy: tp=2 needs MindSpore's semi_auto_parallel, which ms_llm runs only on Ascend.*--backend torch"),
    ("pp-sp", {"tp": 2, "pp": 2, "sequence_parallel": True, "precision": FP32}, 4, {}, [CPU],
     r"^strategy: tp=2, pp=2, sequence_parallel needs"),
    ("cp", {"cp": 2, "precision": FP32}, 2, {}, [CPU], r"^strategy: cp=2 needs"),
    ("native-zero", {"dp": 2, "zero": {"stage": 1, "engine": "native"}, "precision": FP32}, 2, {}, [CPU, CUDA],
     r"^strategy\.zero\.engine: 'native' is MindSpore's parallel optimizer, which runs only on Ascend"),
    ("hsdp", {"dp": 4, "zero": {"stage": 1, "shard_size": 2}, "precision": FP32}, 4, {}, [CPU, CUDA],
     r"^strategy\.zero\.shard_size: 2 < dp = 4 .*AllGather runs only over the world group; use shard_size -1"),
    ("bf16-params", {"dp": 2, "precision": {"param_dtype": "bfloat16", "compute_dtype": "float32"}}, 2, {}, [CPU],
     r"^strategy\.precision\.param_dtype: .*set float32"),
    ("fp16-params", {"precision": {"param_dtype": "float16", "compute_dtype": "float16", "loss_scale": "dynamic"}},
     1, {}, [CPU], r"^strategy\.precision\.param_dtype: .*got float16"),
    ("bf16-compute", {"precision": {"param_dtype": "float32", "compute_dtype": "bfloat16"}}, 1, {}, [CPU],
     r"^strategy\.precision\.compute_dtype: MindSpore has no bfloat16 MatMul"),
    ("reduce-dtype", {"dp": 2, "precision": {**FP32, "grad_reduce_dtype": "float16"}}, 2, {}, [CPU],
     r"^strategy\.precision\.grad_reduce_dtype: .*set float32"),
    ("offload", {"dp": 2, "zero": {"stage": 1}, "offload": {"optimizer": True}, "precision": FP32}, 2, {},
     [CPU, ASCEND], r"^strategy\.offload: the MindSpore backend does not offload"),
    ("moe-hybrid-parallel-optimizer", {"dp": 8, "ep": 4, "zero": {"stage": 1, "shard_size": 4}}, 8,
     {"moe": {"num_experts": 8, "capacity_factor": 1.25}}, [ASCEND],
     r"^strategy\.zero\.shard_size: MindSpore's parallel optimizer takes one shard size .*edp = 2; use shard_size -1"),
    ("moe-parallel-optimizer-experts", {"dp": 8, "ep": 2, "zero": {"stage": 1}}, 8, MOE4, [ASCEND],
     r"^model\.moe\.num_experts: MindSpore's parallel optimizer splits an expert weight .* ep x edp = 2 x 4"),
    ("moe-shared-expert-bias", {"dp": 2, "zero": {"stage": 1}, "precision": FP32}, 2,
     {"moe": {**MOE4["moe"], "score_function": "sigmoid", "expert_bias": True}}, [CPU],
     r"^model\.moe\.expert_bias: MindSpore's shared ZeRO engine \(PyNative\) does not move the expert biases"),
    ("moe-ep", {"dp": 2, "ep": 2, "precision": FP32}, 2, MOE4, [CPU], r"^strategy: ep=2 needs"),
    ("moe-etp", {"dp": 2, "etp": 2, "precision": FP32}, 2, MOE4, [CPU], r"^strategy: etp=2 needs"),
    ("moe-dropless", {"dp": 2, "ep": 2}, 2, {"moe": {"num_experts": 4}}, [ASCEND],
     r"^model\.moe\.capacity_factor: -1 \(dropless\) gives every expert a slot for every token on Ascend"),
    ("zero-bubble", {"pp": 2, "pipeline": {"schedule": "zero_bubble"}, "precision": FP32}, 2, {}, [ASCEND],
     r"^strategy\.pipeline\.schedule: MindSpore has no 'zero_bubble' scheduler"),
    ("shared-with-tp", {"dp": 2, "tp": 2, "zero": {"stage": 1, "engine": "shared"}}, 4, {}, [ASCEND],
     r"^strategy\.zero\.engine: the shared engine runs MindSpore in DATA_PARALLEL mode, which cannot take tp=2"),
]


@pytest.mark.parametrize("case", MS_REFUSALS, ids=[c[0] for c in MS_REFUSALS])
def test_mindspore_refusals_name_the_field(case):
    _, strategy, world, model, machines, message = case
    p = plan_for(strategy, world, {**MODEL, **model})
    for machine in machines:
        refused(ms_support, p, machine, message)


def test_mindspore_refuses_a_memory_limit_it_does_not_apply():
    refused(ms_support, plan_for({"precision": FP32}, 1, memory_limit_gb=1.0), CPU,
            r"^train\.memory_limit_gb: the MindSpore backend does not cap worker memory yet; set 0")


@pytest.mark.parametrize("strategy,world", [
    ({"tp": 2, "precision": FP32}, 2),
    ({"dp": 2, "zero": {"stage": 1, "engine": "native"}, "precision": FP32}, 2),
    ({"dp": 4, "zero": {"stage": 1, "shard_size": 2}, "precision": FP32}, 4),
    ({"dp": 2, "tp": 2, "pp": 2, "sequence_parallel": True}, 8),       # bfloat16, the default precision
])
def test_what_mindspore_refuses_on_cpu_runs_on_ascend(strategy, world):
    p = plan_for(strategy, world)
    assert ms_support.refusals(p, CPU)
    assert ms_support.refusals(p, ASCEND) == []


def test_mindspore_moe_expert_parallel_runs_on_ascend():
    """ep x tp over the MoE layer is lowered (lower_moe.py): refused on CPU, accepted on Ascend."""
    p = plan_for({"dp": 2, "ep": 2, "tp": 2}, 4, MOE_MODEL)
    assert ms_support.refusals(p, CPU)
    assert ms_support.refusals(p, ASCEND) == []
    # float16 with loss scaling: the router losses' gradient is scaled with the loss (test_ms_moe.py)
    assert ms_support.refusals(plan_for({"dp": 2, "precision": FP16}, 2, MOE_MODEL), CPU) == []
    # ZeRO with experts: the shared engine's partition on CPU, the parallel optimizer over edp on Ascend
    assert ms_support.zero_engine(plan_for({"dp": 2, "zero": {"stage": 1}, "precision": FP32}, 2, MOE_MODEL),
                                  CPU) == "shared"
    assert ms_support.refusals(plan_for({"dp": 4, "ep": 2, "zero": {"stage": 3}}, 4, MOE_MODEL), ASCEND) == []


@pytest.mark.parametrize("strategy,world,machine,engine", [
    ({"precision": FP32}, 1, CPU, "none"),
    ({"dp": 2, "precision": FP32}, 2, CPU, "grad_reducer"),                      # ZeRO-0: the compiled step
    ({"dp": 2, "zero": {"engine": "shared"}, "precision": FP32}, 2, CPU, "shared"),
    ({"dp": 2, "zero": {"stage": 1}, "precision": FP32}, 2, CPU, "shared"),
    ({"dp": 2, "zero": {"stage": 3, "engine": "shared"}, "precision": FP16}, 2, CPU, "shared"),
    ({"dp": 2, "zero": {"stage": 2}}, 2, ASCEND, "parallel_optimizer"),          # Ascend: auto = its own ZeRO
    ({"dp": 2, "zero": {"stage": 2, "engine": "shared"}}, 2, ASCEND, "shared"),
    ({"dp": 2, "zero": {"stage": 1, "engine": "native"}}, 2, ASCEND, "parallel_optimizer"),
    ({"dp": 2, "tp": 2, "zero": {"stage": 1}}, 4, ASCEND, "parallel_optimizer"),
    ({"dp": 2, "tp": 2}, 4, ASCEND, "grad_reducer"),
])
def test_mindspore_engine_choice(strategy, world, machine, engine):
    assert ms_support.zero_engine(plan_for(strategy, world), machine) == engine
    assert engine in ms_support.ENGINES


def test_mindspore_engine_refusal_is_raised_by_zero_engine():
    p = plan_for({"dp": 4, "zero": {"stage": 2, "shard_size": 2}, "precision": FP32}, 4)
    with pytest.raises(StrategyError, match="strategy.zero.shard_size"):
        ms_support.zero_engine(p, CPU)
    assert ms_support.zero_engine(p, ASCEND) == "parallel_optimizer"     # HSDP: the optimizer shard size


def test_plans_the_end_to_end_tests_train_are_accepted():
    """tests/mindspore/test_ms_train.py, test_zero_mindspore.py, test_zero_torch.py and test_torch_train.py
    train these plans for real; support must accept them with the engine they exercise."""
    ms_job = load_job(ROOT / "configs/train/tiny_ms_dp2.yaml")
    torch_job = load_job(ROOT / "configs/train/tiny_torch_dp2.yaml")
    ms_plan = make_plan(ms_job.model, ms_job.strategy, ms_job.train)
    assert backends.refusals("mindspore", ms_plan, CPU) == []
    assert backends.zero_engine("mindspore", ms_plan, CPU) == "grad_reducer"
    torch_plan = make_plan(torch_job.model, torch_job.strategy, torch_job.train)
    assert backends.refusals("torch", torch_plan, CPU) == []
    for stage in (1, 2, 3):
        zero = make_plan(ZERO_MODEL, strategy_for(2, stage), train_config(2, "sgd"), 2)
        assert backends.zero_engine("mindspore", zero, CPU) == "shared"
        assert backends.zero_engine("torch", zero, CPU) == "shared"
        assert backends.refusals("mindspore", zero, CPU) == backends.refusals("torch", zero, CPU) == []


@pytest.mark.parametrize("case", list(TORCH_MATRIX))
def test_torch_matrix_cases_are_accepted(case):
    """tests/torch/test_torch_matrix.py trains each of these through lower() and checks the result."""
    world, strategy, _ = TORCH_MATRIX[case]
    job = job_for(case)
    p = make_plan(job.model, job.strategy, job.train, world)
    assert torch_support.refusals(p, CPU) == []
    engine = torch_support.zero_engine(p, CPU)
    if p.strategy.dp * p.strategy.cp == 1:         # cp ranks reduce gradients too
        assert engine == "none"
    else:
        assert (engine == "shared") == (strategy.get("zero", {}).get("engine") != "native")


def test_backends_dispatch_and_verdict():
    p = plan_for({"tp": 2, "precision": FP32}, 2)
    assert backends.refusals("torch", p, CPU) == []
    with pytest.raises(StrategyError, match="semi_auto_parallel"):
        backends.check("mindspore", p, CPU)
    with pytest.raises(StrategyError, match="--backend: 'jax' is not a backend"):
        backends.refusals("jax", p, CPU)
    answer = backends.verdict("mindspore", p, CPU)
    assert not answer.runs and answer.engine == "none" and answer.to_json()["accelerator"] == "cpu"
    hsdp = backends.verdict("mindspore", plan_for({"dp": 4, "zero": {"stage": 1, "shard_size": 2},
                                                   "precision": FP32}, 4), CPU)
    assert hsdp.engine is None and hsdp.lines()[0] == "backend    mindspore on cpu: refused:"


def test_machine_detection_and_devices(tmp_path):
    assert Machine.detect(tmp_path) == CPU
    (tmp_path / "nvidia0").touch()
    assert Machine.detect(tmp_path) == CUDA
    (tmp_path / "davinci0").touch()
    assert Machine.detect(tmp_path) == ASCEND
    assert set(DEVICE_ACCELERATORS) == set(DEVICES)
    assert Machine.running(get_device("910b")) == ASCEND and Machine.running(get_device("h100")) == CUDA
    with pytest.raises(Exception, match="unknown accelerator 'tpu'"):
        Machine("tpu")


def ms_llm(*args):
    return subprocess.run([sys.executable, "-m", "ms_llm", *args], capture_output=True, text=True, cwd=ROOT)


def job_file(tmp_path, strategy: dict, backend: str = "torch") -> str:
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"name": "support", "backend": backend, "device": "cpu", "model": MODEL,
                                "strategy": strategy, "train": {"global_batch_size": 8, "seq_len": 16}}))
    return str(path)


def test_plan_backend_mindspore_refuses_tp_with_exit_2(tmp_path):
    job = job_file(tmp_path, {"dp": 1, "tp": 2, "precision": FP32})
    out = ms_llm("plan", job, "--backend", "mindspore")
    assert out.returncode == 2, out.stderr
    assert "backend    mindspore on cpu: ZeRO engine none; refused:" in out.stdout
    assert "  - strategy: tp=2 needs MindSpore's semi_auto_parallel" in out.stdout
    assert "mindspore cannot run this plan on cpu" in out.stderr
    out = ms_llm("plan", job, "--backend", "mindspore", "--device", "910b")
    assert out.returncode == 0 and "backend    mindspore on ascend: ZeRO engine none" in out.stdout
    assert ms_llm("plan", job).returncode == 0                        # the job's backend: torch


def test_plan_backend_torch_runs_cp_that_mindspore_refuses_on_cpu(tmp_path):
    job = job_file(tmp_path, {"cp": 2, "dp": 2}, backend="mindspore")
    out = ms_llm("plan", job, "--backend", "torch", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    answer = json.loads(out.stdout)["backend"]
    assert answer["backend"] == "torch" and answer["engine"] == "shared" and answer["runs"]
    out = ms_llm("plan", job)                                          # the job's backend: mindspore
    assert out.returncode == 2 and "strategy: cp=2 needs" in out.stdout


def test_plan_reports_the_engine_of_an_accepted_plan():
    out = ms_llm("plan", "configs/train/tiny_ms_dp2.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("backend    mindspore on cpu: ZeRO engine grad_reducer")


def test_torch_refuses_an_ascend_machine_and_names_the_fix():
    p = plan_for({"dp": 2, "precision": FP32}, 2)
    problems = torch_support.refusals(p, ASCEND)
    assert problems and problems[0].startswith("device: the torch backend runs on CUDA GPUs (NCCL) or CPUs (gloo)")
    assert "--backend mindspore" in problems[0]
    assert torch_support.refusals(p, CPU) == []

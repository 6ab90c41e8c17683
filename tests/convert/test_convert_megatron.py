"""Megatron-LM launch scripts and argument lists -> IR, resolved the way Megatron resolves them."""
import dataclasses
from pathlib import Path

import pytest

from ms_llm.convert import ConversionError, ReadOptions, dump, from_job, load, read
from ms_llm.convert.shell import launch_command
from ms_llm.job import load_job

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "configs" / "examples"    # the peers' configs users convert


def test_gpt3_175b_script():
    conv = load(FIXTURES / "megatron_gpt3_175b.sh")
    m, s, t = conv.job.model, conv.job.strategy, conv.job.train
    assert conv.world_size == 1024                                  # torchrun 8 x 128 nodes
    assert (s.dp, s.tp, s.pp, s.cp, s.sequence_parallel) == (8, 8, 16, 1, False)     # dp = 1024 / (8*16)
    assert (s.zero.stage, s.pipeline.schedule, s.recompute.policy) == (0, "1f1b", "none")
    assert (s.precision.param_dtype, s.precision.master_dtype, s.precision.loss_scale) == \
        ("float16", "float32", "dynamic")
    assert s.precision.initial_loss_scale == 2.0 ** 32             # Megatron's --initial-loss-scale default
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == (96, 12288, 96, 96)
    assert m.vocab_size == 51200                                    # GPT-2 BPE 50257 padded to 128 * tp
    assert m.ffn_hidden_size == 32768                               # 4h GELU -> equal-size SwiGLU
    assert not m.tie_embeddings and m.max_seq_len == 2048
    assert (t.global_batch_size, t.micro_batch_size, t.seq_len, t.steps) == (1536, 1, 2048, 500000)
    assert t.optimizer.lr == 6e-5 and t.schedule.min_lr_ratio == pytest.approx(0.1)
    assert t.schedule.decay == "cosine" and t.schedule.warmup_steps == 430    # .001 * lr-decay-iters
    assert (t.optimizer.weight_decay, t.optimizer.beta2, t.checkpoint.interval) == (0.1, 0.95, 10000)
    text = "\n".join(conv.warnings)
    for expected in ("--rampup-batch-size", "untied", "RMSNorm", "rotary", "dropout", "--data-path",
                     "--tensorboard-dir", "biases", "430000 steps"):
        assert expected in text


def test_llama3_8b_script_with_branches():
    conv = load(FIXTURES / "megatron_llama3_8b.sh")
    m, s, t = conv.job.model, conv.job.strategy, conv.job.train
    assert conv.world_size == 8 and (s.dp, s.tp, s.cp) == (8, 1, 1)
    assert not s.sequence_parallel                                  # dropped: tp = 1, as Megatron does
    assert s.zero.stage == 1                                        # --use-distributed-optimizer
    assert (s.precision.param_dtype, s.precision.grad_reduce_dtype) == ("bfloat16", "bfloat16")
    assert (m.vocab_size, m.num_kv_heads, m.ffn_hidden_size, m.rope_theta) == (128256, 8, 14336, 1e6)
    assert (t.global_batch_size, t.seq_len, t.steps) == (128, 8192, 1953125000 // 128)
    assert t.checkpoint.load == "checkpoints/llama3_8b_fp8"         # ${1:-default} took the default
    text = "\n".join(conv.warnings)
    assert "--fp8-format hybrid" in text and "--sequence-parallel with tp = 1" in text
    assert "--mock-data" in text and "HuggingFaceTokenizer" not in text     # the MOCK branch ran
    assert "not a string test" in text                               # the [ ! -f ... ] branch was skipped


def test_world_size_from_the_command_line_overrides_the_launcher():
    conv = load(FIXTURES / "megatron_gpt3_175b.sh", options=ReadOptions(world_size=2048))
    assert conv.world_size == 2048 and conv.job.strategy.dp == 16
    assert any("launches 1024 processes" in w for w in conv.warnings)


def test_single_node_launcher_contradicts_tp8_pp16():
    text = (FIXTURES / "megatron_gpt3_175b.sh").read_text().replace("NUM_NODES=128", "NUM_NODES=1")
    with pytest.raises(ConversionError, match=r"world size 8 is not divisible by tp\*pp\*cp = 8\*16\*1.*--world-size"):
        read(text, "gpt3.sh")


ARGS = """--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \\
  --num-layers-per-virtual-pipeline-stage 2 --sequence-parallel --num-layers 32 --hidden-size 4096 \\
  --num-attention-heads 32 --group-query-attention --num-query-groups 8 --ffn-hidden-size 14336 --swiglu \\
  --untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope \\
  --disable-bias-linear --attention-dropout 0 --hidden-dropout 0 --vocab-size 128256 --seq-length 4096 \\
  --micro-batch-size 1 --global-batch-size 64 --bf16 --recompute-granularity full --recompute-method block \\
  --recompute-num-layers 2 --use-distributed-optimizer --num-distributed-optimizer-instances 2 --lr 3e-4
"""


def test_argument_list_with_interleaving_block_recompute_and_optimizer_instances():
    conv = read(ARGS, "llama.args", options=ReadOptions(world_size=32))
    s = conv.job.strategy
    assert (s.dp, s.tp, s.pp, s.pipeline.virtual_stages, s.pipeline.schedule) == (4, 2, 4, 4, "interleaved_1f1b")
    assert (s.recompute.policy, s.recompute.num_layers) == ("full", 2)
    assert (s.zero.stage, s.zero.shard_size) == (1, 2)             # 2 optimizer instances over dp 4
    assert s.sequence_parallel and conv.warnings == []


def test_qwen_arguments_and_weighted_data_read_and_write_back():
    """--kv-channels / --qk-layernorm / --add-qkv-bias / --use-rope-scaling and the data arguments
    are model and train.data fields; the script we write says them again."""
    extra = ("--kv-channels 256 --qk-layernorm --add-qkv-bias --use-rope-scaling --rope-scaling-factor 16 "
             "--data-path 0.3 /data/web 0.7 /data/code --split 98,2,0 --tokenizer-model Qwen/Qwen3-8B")
    conv = read(ARGS + " " + extra, "qwen.args", options=ReadOptions(world_size=32))
    m, d = conv.job.model, conv.job.train.data
    assert (m.head_dim, m.qk_norm, m.qkv_bias, m.rope_scaling.type, m.rope_scaling.factor) == \
        (256, True, True, "llama3", 16.0)
    assert (m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor, m.rope_scaling.original_max_seq_len) \
        == (1.0, 4.0, 8192)                                         # megatron-core's fixed Llama-3.1 bands
    assert (d.paths, d.weights, d.split, d.tokenizer) == (("/data/web", "/data/code"), (0.3, 0.7), "98,2,0",
                                                          "Qwen/Qwen3-8B")
    assert conv.warnings == []
    written = dump(conv, "megatron")
    assert "--data-path 0.3 /data/web 0.7 /data/code" in written.text and written.warnings == []
    back = read(written.text, "qwen.sh")
    assert back.job.model == m and back.job.train.data == d
    plain = read(ARGS + " --data-path /data/a /data/b", "p.args", options=ReadOptions(world_size=32)).job.train.data
    assert (plain.paths, plain.weights) == (("/data/a", "/data/b"), ())
    with pytest.raises(ConversionError, match="--data-path: got '0.3 /data/a /data/b'"):
        read(ARGS + " --data-path 0.3 /data/a /data/b", "p.args", options=ReadOptions(world_size=32))


MOE_ARGS = ("--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 1024 --expert-model-parallel-size 4 "
            "--moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax --moe-aux-loss-coeff 1e-3 "
            "--moe-z-loss-coeff 1e-4 --moe-expert-capacity-factor 1.25 --moe-token-drop-policy position "
            "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --context-parallel-size 2 ")


@pytest.mark.parametrize("extra,layers", [
    ("--moe-layer-freq 2", (2, 0)), ("--moe-layer-freq '([0]*2+[1]*30)'", (1, 2)),
    ("--moe-layer-freq [0,0]+[1,0]*15", (2, 2)), ("", (1, 0))])
def test_moe_and_cp_flags_are_model_moe_and_the_algorithm(extra, layers):
    """Megatron's MoE flags and layer patterns read into model.moe, --cp-comm-type into the
    algorithm (p2p, Megatron's default, is ring); the script we write reads back the same."""
    conv = read(ARGS + MOE_ARGS + extra, "moe.args", options=ReadOptions(world_size=64))
    m, s = conv.job.model, conv.job.strategy
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_hidden_size, m.moe.shared_experts) == (8, 2, 1024, 2)
    assert (m.moe.normalize_top_k, m.moe.aux_loss_coeff, m.moe.z_loss_coeff, m.moe.capacity_factor) == \
        (False, 1e-3, 1e-4, 1.25)
    assert (m.moe.layer_freq, m.moe.first_dense_layers) == layers and m.ffn_hidden_size == 14336
    assert (s.cp, s.ep, s.context_parallel.algorithm) == (2, 4, "ring") and conv.warnings == []
    written = dump(conv, "megatron")
    assert written.warnings == []
    back = read(written.text, "moe.sh")
    assert back.job.model == m and back.job.strategy == s


@pytest.mark.parametrize("flag,ep,etp,edp", [("", 4, 2, 1), ("--expert-tensor-parallel-size 1", 4, 1, 2),
                                             ("--expert-tensor-parallel-size 4", 2, 4, 1)])
def test_expert_tensor_parallel_folds_the_experts(flag, ep, etp, edp):
    """--expert-tensor-parallel-size (Megatron's default: tp) is strategy.etp: the experts fold over a
    stage's dp 4 x tp 2 ranks as edp x ep x etp, etp 1 taking the tp ranks into ep, etp 4 dp ranks into
    etp. The script we write says it when it is not tp, and reads back the same."""
    moe = MOE_ARGS.replace("--context-parallel-size 2 ", "").replace("--expert-model-parallel-size 4",
                                                                     f"--expert-model-parallel-size {ep}")
    conv = read(ARGS + moe + flag, "fold.args", options=ReadOptions(world_size=32))
    s = conv.job.strategy
    assert (s.dp, s.tp, s.ep, s.expert_tp, s.edp) == (4, 2, ep, etp, edp) and conv.warnings == []
    assert s.etp == (-1 if etp == 2 else etp)                   # canonical: -1 is "= tp"
    written = dump(conv, "megatron")
    assert written.warnings == [] and (f"--expert-tensor-parallel-size {etp}" in written.text) == (etp != 2)
    assert read(written.text, "fold.sh").job.strategy == s


def test_expert_tensor_parallel_of_a_dense_model_is_dropped():
    conv = read(ARGS + "--expert-tensor-parallel-size 1", "dense.args", options=ReadOptions(world_size=32))
    assert conv.job.strategy.etp == -1
    assert conv.warnings == ["--expert-tensor-parallel-size 1: the model has no experts; dropped"]


@pytest.mark.parametrize("kind,algorithm,warned", [
    ("p2p", "ring", False), ("a2a", "ulysses", False), ("all_gather", "allgather", False),
    ("a2a+p2p", "ring", True), ("a2a p2p", "ulysses", True)])
def test_cp_comm_type(kind, algorithm, warned):
    conv = read(ARGS + f"--context-parallel-size 2 --cp-comm-type {kind}", "cp.args",
                options=ReadOptions(world_size=64))
    assert conv.job.strategy.context_parallel.algorithm == algorithm
    assert any(w.startswith("--cp-comm-type") for w in conv.warnings) is warned


@pytest.mark.parametrize("pattern,message", [
    ("[1]*31", "is not a 0/1 flag for each of the 32 layers"),
    ("[0]*32", "with at least one MoE layer"),
    ("[__import__('os')]", "expected an integer or a list expression"), ("two", "expected an integer")])
def test_unreadable_moe_layer_patterns_name_the_flag(pattern, message):
    with pytest.raises(ConversionError, match=f"--moe-layer-freq: .*{message}"):
        read(ARGS + MOE_ARGS + f"--moe-layer-freq \"{pattern}\"", "moe.args", options=ReadOptions(world_size=64))


@pytest.mark.parametrize("change,message", [
    ("--bf16", "--fp16: given together with --bf16"),
    ("--recompute-method block", "--recompute-granularity: full needs --recompute-method"),
    ("--global-batch-size 64", "--global-batch-size: 63 is not a multiple of micro batch \\* dp"),
    ("--num-layers 32", "--num-layers: missing"),
    ("--tensor-model-parallel-size 2", "--tensor-model-parallel-size: got 'two'"),
])
def test_contradictory_or_unreadable_arguments(change, message):
    broken = {"--bf16": ARGS.replace("--bf16", "--bf16 --fp16"),
              "--recompute-method block": ARGS.replace("--recompute-method block", ""),
              "--global-batch-size 64": ARGS.replace("--global-batch-size 64", "--global-batch-size 63"),
              "--num-layers 32": ARGS.replace("--num-layers 32", ""),
              "--tensor-model-parallel-size 2": ARGS.replace("--tensor-model-parallel-size 2",
                                                             "--tensor-model-parallel-size two")}[change]
    with pytest.raises(ConversionError, match=f"llama.args: {message}"):
        read(broken, "llama.args", options=ReadOptions(world_size=32))


def test_invalid_strategy_points_at_the_flag():
    with pytest.raises(ConversionError) as err:
        read(ARGS.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 16"), "llama.args",
             options=ReadOptions(world_size=256))
    assert "strategy.tp" in str(err.value) and "[source: --tensor-model-parallel-size]" in str(err.value)


def test_shell_subset():
    script = """
    NODES=${NNODES:-4}
    GPUS=8
    WORLD=$(($GPUS*$NODES))
    A=(--x 1 # a comment (with parentheses)
       "--y two words")
    A+=(--z)
    MODE=b
    if [[ "$MODE" == "a" ]]; then
        A+=(--from-a)
    elif [[ "$MODE" == "b" ]] && [[ -n "$GPUS" ]]; then
        A+=(--from-b)
    else
        A+=(--from-else)
    fi
    python -m torch.distributed.run --nnodes $NODES train.py ${A[@]} --world $WORLD
    """
    launch = launch_command(script, "s.sh")
    assert launch.program == "train.py"
    assert launch.args == ["--x", "1", "--y", "two", "words", "--z", "--from-b", "--world", "32"]
    with pytest.raises(ConversionError, match="no command that runs a .py program"):
        launch_command("echo hello\n", "s.sh")


def test_a_file_name_that_is_no_job_name_is_made_one(tmp_path):
    """The job is named after the converted file: spaces and other characters a run folder's name
    cannot hold become '_', a leading dot goes."""
    for file_name, job_name in (("my llama (v2).sh", "my_llama__v2_"), (".hidden run.sh", "hidden_run")):
        path = tmp_path / file_name
        path.write_text((FIXTURES / "megatron_llama3_8b.sh").read_text())
        assert load(path).job.name == job_name


@pytest.mark.parametrize("from_zero", [True, False])
def test_warmup_from_zero_is_read_and_a_later_warmup_is_said(from_zero):
    """Megatron's scheduler runs update k of its warmup at lr*(k-1)/warmup: read as warmup_from_zero,
    and a job without it is written with a warning that names the field."""
    assert load(FIXTURES / "megatron_gpt3_175b.sh").job.train.schedule.warmup_from_zero     # warmup 430
    job = load_job(ROOT / "configs" / "train" / "tiny_ms_dp2.yaml")                          # warmup 5
    job = dataclasses.replace(job, train=dataclasses.replace(
        job.train, schedule=dataclasses.replace(job.train.schedule, warmup_from_zero=from_zero)))
    out = dump(from_job(job, job.strategy.dp), "megatron")
    said = [w for w in out.warnings if "train.schedule.warmup_from_zero" in w]
    assert len(said) == (0 if from_zero else 1) and all("warmup starts at 0" in w for w in said)
    back = read(out.text, "out.sh", "megatron", ReadOptions(world_size=job.strategy.dp, model=job.model))
    assert back.job.train.schedule.warmup_from_zero and back.job.train.schedule.warmup_steps == 5

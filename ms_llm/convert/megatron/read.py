"""Megatron-LM command-line arguments -> IR (megatron_script.py writes them back).

Reads a launch script (`torchrun ... pretrain_gpt.py --flag value ...`, see shell.py) or a file
holding just the arguments. The world size is torchrun's nproc_per_node * nnodes or --world-size.
Implicit values are resolved as Megatron's arguments.py does: dp = world / (tp * pp * cp),
global batch = micro batch * dp when unset, sequence parallel dropped when tp = 1, vocabulary
padded to a multiple of make-vocab-size-divisible-by * tp, embeddings tied unless
--untie-embeddings-and-output-weights, dropout 0.1, weight decay 0.01, Adam beta2 0.999.
"""
from __future__ import annotations

import ast
import math
import shlex
from pathlib import Path

from ms_llm.convert.common import ConversionError, Converted, Fields, ReadOptions, make_job
from ms_llm.convert.shell import launch_command

GPT2_BPE_VOCAB = 50257          # Megatron's GPT2BPETokenizer (the GPT-3 examples' --vocab-file/--merge-file)
# --cp-comm-type (megatron-core TransformerConfig.cp_comm_type) <-> strategy.context_parallel.algorithm;
# a2a+p2p (hierarchical: a2a inside --hierarchical-context-parallel-sizes groups, p2p across) has no IR name.
CP_COMM_TYPES = {"p2p": "ring", "a2a": "ulysses", "all_gather": "allgather"}
# megatron-core's RotaryEmbedding._apply_scaling: Llama-3.1's bands fixed, only the factor is an argument.
MEGATRON_LLAMA3 = {"type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}
DECAY_STYLES = {"cosine": "cosine", "linear": "linear", "constant": "constant"}


def parse_args(words: list[str], source: str) -> dict[str, object]:
    """argparse-like: `--flag` -> True, `--flag v` -> 'v', `--flag a b c` -> ['a', 'b', 'c']."""
    out: dict[str, object] = {}
    flag = None
    for word in words:
        if word.startswith("--"):
            flag, _, value = word.partition("=")
            out[flag] = value if value else True
        elif flag is None:
            raise ConversionError(f"{source}: {word!r} comes before any --flag; Megatron-LM takes only --flags")
        else:
            current = out[flag]
            if current is True:
                out[flag] = word
            else:
                out[flag] = (current if isinstance(current, list) else [current]) + [word]
    return out


def world_from_launcher(launcher: list[str], source: str, warnings: list[str]) -> int | None:
    """nproc_per_node * nnodes of a torchrun launcher; None for any other launcher."""
    if not any(Path(w).name in ("torchrun", "torch.distributed.run") for w in launcher):
        return None
    first = next((i for i, w in enumerate(launcher) if w.startswith("--")), len(launcher))
    opts = parse_args(launcher[first:], source)
    f = Fields({k.replace("_", "-"): v for k, v in opts.items()}, source, text=True)
    nproc = f.get("--nproc-per-node", str, "1")
    nnodes = f.get("--nnodes", str, "1")
    if ":" in nnodes:
        nnodes = nnodes.split(":")[1]
        warnings.append(f"torchrun --nnodes is elastic; planning for its maximum, {nnodes} nodes")
    if not (nproc.isdigit() and nnodes.isdigit()):
        warnings.append(f"torchrun --nproc_per_node {nproc!r} --nnodes {nnodes!r}: not numbers; "
                        "world size unknown (pass --world-size)")
        return None
    return int(nproc) * int(nnodes)


def read(text: str, source: str, options: ReadOptions) -> Converted:
    warnings: list[str] = []
    code = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    words = shlex.split(text.replace("\\\n", " "), comments=True) if code and code[0].startswith("--") else None
    launched = None
    if words is None:
        launch = launch_command(text, source)
        words, warnings = launch.args, warnings + launch.notes
        launched = world_from_launcher(launch.launcher, source, warnings)
    f = Fields(parse_args(words, source), source, text=True)
    world = options.world_size or launched
    if options.world_size and launched and options.world_size != launched:
        warnings.append(f"the script launches {launched} processes; planning for --world-size {options.world_size}")

    tp = f.get("--tensor-model-parallel-size", int, 1, ir="strategy.tp")
    pp = f.get("--pipeline-model-parallel-size", int, 1, ir="strategy.pp")
    cp = f.get("--context-parallel-size", int, 1, ir="strategy.cp")
    ep = f.get("--expert-model-parallel-size", int, 1, ir="strategy.ep")
    dp = world // (tp * pp * cp) if world and world % (tp * pp * cp) == 0 else None
    if world and dp is None:
        raise ConversionError(f"{source}: world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} "
                              f"(Megatron computes dp = world / (tp*pp*cp)); pass --world-size N with a multiple "
                              f"of {tp * pp * cp}")
    model, tie_note = _model(f, tp, pp, warnings)
    strategy = {"dp": dp or -1, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                "context_parallel": {"algorithm": _cp_algorithm(f, cp, warnings)}}
    sp = f.get("--sequence-parallel", bool, False, ir="strategy.sequence_parallel")
    if sp and tp == 1:
        warnings.append("--sequence-parallel with tp = 1: Megatron turns it off, and so does this conversion")
        sp = False
    strategy["sequence_parallel"] = sp
    strategy["pipeline"] = _pipeline(f, model["num_layers"], pp)
    strategy["zero"] = _zero(f, dp)
    strategy["recompute"] = _recompute(f, warnings)
    strategy["precision"] = _precision(f, warnings)
    strategy["offload"] = {"optimizer": f.get("--optimizer-cpu-offload", bool, False, ir="strategy.offload")}
    model["dtype"] = strategy["precision"]["param_dtype"]
    train = _train(f, dp, warnings)
    if tie_note:
        warnings.append(tie_note)
    job = make_job(f, name=Path(source).stem, model=model, strategy=strategy, train=train,
                   device=options.device or "h100")
    return Converted(job, world, warnings + f.unused(), f.sources)


def _model(f: Fields, tp: int, pp: int, warnings: list[str]) -> tuple[dict, str]:
    layers = f.get("--num-layers", int, ir="model.num_layers")
    hidden = f.get("--hidden-size", int, ir="model.hidden_size")
    heads = f.get("--num-attention-heads", int, ir="model.num_heads")
    kv = heads
    if f.get("--group-query-attention", bool, False):
        kv = f.get("--num-query-groups", int, 1, ir="model.num_kv_heads")
    swiglu = f.get("--swiglu", bool, False)
    default_ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden
    ffn = f.get("--ffn-hidden-size", int, default_ffn, ir="model.ffn_hidden_size")
    if not swiglu:
        if (2 * ffn) % 3:
            raise f.error("--ffn-hidden-size", f"a {ffn}-wide GELU MLP has no SwiGLU equivalent of equal size "
                                               "(2*ffn/3 is not an integer); ms_llm models are SwiGLU")
        warnings.append(f"no --swiglu: the {ffn}-wide GELU MLP is read as a SwiGLU MLP of width {2 * ffn // 3} "
                        "(same parameter count)")
        ffn = 2 * ffn // 3
    vocab = _vocab(f, tp, warnings)
    position = f.get("--position-embedding-type", str, "learned_absolute")
    if position != "rope":
        warnings.append(f"--position-embedding-type {position}: read as rotary embeddings (ms_llm models use RoPE)")
    if f.get("--rotary-percent", float, 1.0) != 1.0:
        warnings.append("--rotary-percent < 1 is not modelled; full rotary embeddings are used")
    norm = f.get("--normalization", str, "LayerNorm")
    if norm != "RMSNorm":
        warnings.append(f"--normalization {norm}: read as RMSNorm")
    if not f.get("--disable-bias-linear", bool, False):
        warnings.append("linear-layer biases (Megatron's default without --disable-bias-linear) are not modelled; "
                        "only q/k/v biases are (--disable-bias-linear --add-qkv-bias)")
    dropout = (f.get("--attention-dropout", float, 0.1), f.get("--hidden-dropout", float, 0.1))
    if any(dropout):
        warnings.append(f"dropout (attention {dropout[0]}, hidden {dropout[1]}; Megatron's default is 0.1) "
                        "is not modelled")
    tie = not f.get("--untie-embeddings-and-output-weights", bool, False, ir="model.tie_embeddings")
    note = ""
    if tie and pp > 1:
        tie = False
        note = ("embeddings are tied (no --untie-embeddings-and-output-weights) across pipeline stages; "
                "ms_llm has no embedding group, so they are untied")
    seq = f.get("--seq-length", int, ir="train.seq_len")
    model = {"name": Path(f.source).stem, "vocab_size": vocab, "hidden_size": hidden, "num_layers": layers,
             "num_heads": heads, "num_kv_heads": kv, "ffn_hidden_size": ffn,
             "max_seq_len": f.get("--max-position-embeddings", int, seq, ir="model.max_seq_len"),
             "rope_theta": f.get("--rotary-base", float, 10000.0, ir="model.rope_theta"),
             "norm_eps": f.get("--norm-epsilon", float, 1e-5, ir="model.norm_eps"), "tie_embeddings": tie,
             "flash_attention": _flash_attention(f, warnings), "moe": _moe(f, layers, ffn, warnings),
             "qkv_bias": f.get("--add-qkv-bias", bool, False, ir="model.qkv_bias"),
             "qk_norm": f.get("--qk-layernorm", bool, False, ir="model.qk_norm"),
             "rope_scaling": _rope_scaling(f)}
    if f.has("--kv-channels"):
        model["head_dim"] = f.get("--kv-channels", int, ir="model.head_dim")
    return model, note


def _cp_algorithm(f: Fields, cp: int, warnings: list[str]) -> str:
    """--cp-comm-type (one value, or one per layer); Megatron's default is p2p, i.e. ring."""
    given = f.raw("--cp-comm-type", ir="strategy.context_parallel.algorithm")
    if given is None:
        return "ring" if cp > 1 else "auto"
    kinds = sorted(set([given] if isinstance(given, str) else given))
    if len(kinds) > 1:
        warnings.append(f"--cp-comm-type {' '.join(given)}: one type per layer is not modelled; "
                        f"{given[0]} is read for every layer")
    kind = given if isinstance(given, str) else given[0]
    if kind == "a2a+p2p":
        warnings.append("--cp-comm-type a2a+p2p (hierarchical context parallel) has no ms_llm equivalent; read as "
                        "ring (p2p) over the whole cp group")
        return "ring"
    if kind not in CP_COMM_TYPES:
        raise f.error("--cp-comm-type", f"got {kind!r}; expected one of p2p, a2a, all_gather, a2a+p2p")
    return CP_COMM_TYPES[kind]


def _moe(f: Fields, layers: int, ffn: int, warnings: list[str]) -> dict | None:
    """--num-experts and the --moe-* flags -> model.moe. Megatron's router (softmax after top-k, or
    --moe-router-pre-softmax: softmax over all experts, top-k weights kept raw) is ms_llm's with
    normalize_top_k true / false; its aux-loss coefficient defaults to 0."""
    experts = f.get("--num-experts", int, 0, ir="model.moe.num_experts")
    if not experts:
        return None
    width = f.get("--moe-ffn-hidden-size", int, ffn, ir="model.moe.expert_ffn_hidden_size")
    moe: dict = {"num_experts": experts, "top_k": f.get("--moe-router-topk", int, 2, ir="model.moe.top_k"),
                 "expert_ffn_hidden_size": -1 if width == ffn else width,
                 "normalize_top_k": not f.get("--moe-router-pre-softmax", bool, False, ir="model.moe.normalize_top_k"),
                 "aux_loss_coeff": f.get("--moe-aux-loss-coeff", float, 0.0, ir="model.moe.aux_loss_coeff"),
                 "z_loss_coeff": f.get("--moe-z-loss-coeff", float, 0.0, ir="model.moe.z_loss_coeff")}
    shared = f.get("--moe-shared-expert-intermediate-size", int, 0, ir="model.moe.shared_experts")
    if shared % width:
        raise f.error("--moe-shared-expert-intermediate-size", f"{shared} is not a multiple of the expert width "
                                                               f"{width}; ms_llm's shared experts are expert-wide")
    moe["shared_experts"] = shared // width
    capacity = f.get("--moe-expert-capacity-factor", float, -1.0, ir="model.moe.capacity_factor")
    moe["capacity_factor"] = capacity if capacity > 0 else -1.0
    policy = f.get("--moe-token-drop-policy", ("probs", "position"), "probs")
    if capacity > 0 and policy == "probs":
        warnings.append("--moe-token-drop-policy probs: an over-full expert drops its lowest-weight tokens in "
                        "Megatron; ms_llm drops the latest ones (position)")
    scaling = f.get("--moe-router-topk-scaling-factor", float, 1.0)
    if scaling != 1.0:
        warnings.append(f"--moe-router-topk-scaling-factor {scaling}: routing weights are not scaled in ms_llm")
    f.accept_usual({"--moe-grouped-gemm": None, "--moe-token-dispatcher-type": None,
                    "--moe-router-load-balancing-type": ("aux_loss",), "--moe-router-score-function": ("softmax",)})
    if f.has("--moe-layer-freq"):
        moe.update(_moe_layer_pattern(f, layers))
    return moe


def _moe_layer_pattern(f: Fields, layers: int) -> dict:
    """--moe-layer-freq N, or a pattern such as "([0]*3+[1]*29)" -> layer_freq + first_dense_layers."""
    text = f.get("--moe-layer-freq", str, ir="model.moe.layer_freq")
    if "[" not in text:
        return {"layer_freq": f.get("--moe-layer-freq", int)}
    pattern = _list_expression(f, text)
    if len(pattern) != layers or set(pattern) - {0, 1} or 1 not in pattern:
        raise f.error("--moe-layer-freq", f"{text!r} is not a 0/1 flag for each of the {layers} layers "
                                          "with at least one MoE layer")
    first = pattern.index(1)
    for freq in range(1, layers + 1):
        if pattern == [int(i >= first and i % freq == 0) for i in range(layers)]:
            return {"layer_freq": freq, "first_dense_layers": first}
    raise f.error("--moe-layer-freq", f"{text!r}: ms_llm places MoE layers as leading dense layers, then every "
                                      "N-th layer; this pattern is neither")


def _list_expression(f: Fields, text: str) -> list:
    """Megatron evaluates the pattern as Python; here only lists of ints, + and * are accepted."""
    def value(node):
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int) \
                    and 0 <= right <= 1 << 16:
                return left * right
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
        raise ValueError
    try:
        out = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        raise f.error("--moe-layer-freq", f"{text!r}: expected an integer or a list expression such as "
                                          "[0]*3+[1]*29") from None
    if not isinstance(out, list):
        raise f.error("--moe-layer-freq", f"{text!r}: expected a list of 0/1 flags")
    return out


def _rope_scaling(f: Fields) -> dict:
    """--use-rope-scaling is Llama-3.1's scaling with Megatron's fixed bands (MEGATRON_LLAMA3) and
    --rope-scaling-factor; --rotary-seq-len-interpolation-factor divides positions (linear)."""
    if f.get("--use-rope-scaling", bool, False, ir="model.rope_scaling"):
        return {**MEGATRON_LLAMA3, "factor": f.get("--rope-scaling-factor", float, 8.0, ir="model.rope_scaling")}
    linear = f.get("--rotary-seq-len-interpolation-factor", int, 0, ir="model.rope_scaling")
    return {"type": "linear", "factor": linear} if linear else {}


def _flash_attention(f: Fields, warnings: list[str]) -> bool:
    """--attention-backend flash (or the legacy --use-flash-attn) is model.flash_attention."""
    backend = f.get("--attention-backend", ("flash", "fused", "unfused", "local", "auto"), "auto",
                    ir="model.flash_attention")
    if backend in ("fused", "auto") and f.has("--attention-backend"):
        what = "Megatron's pick among Transformer Engine's kernels" if backend == "auto" else "cuDNN fused attention"
        warnings.append(f"--attention-backend {backend} ({what}): read as plain attention "
                        "(model.flash_attention false)")
    legacy = f.get("--use-flash-attn", bool, False, ir="model.flash_attention")
    return backend == "flash" or legacy


def _vocab(f: Fields, tp: int, warnings: list[str]) -> int:
    if f.has("--vocab-size"):
        vocab = f.get("--vocab-size", int, ir="model.vocab_size")
    elif f.has("--merge-file") or f.get("--tokenizer-type", str, "") == "GPT2BPETokenizer":
        vocab = GPT2_BPE_VOCAB
        warnings.append(f"vocabulary: the GPT-2 BPE tokenizer's {GPT2_BPE_VOCAB} tokens")
    else:
        raise f.error("--vocab-size", "missing, and the tokenizer cannot be read offline; add --vocab-size N "
                                      "(the tokenizer's vocabulary size)")
    multiple = f.get("--make-vocab-size-divisible-by", int, 128) * tp
    padded = math.ceil(vocab / multiple) * multiple
    if padded != vocab:
        warnings.append(f"vocabulary padded from {vocab} to {padded} (a multiple of "
                        f"make-vocab-size-divisible-by * tp = {multiple}), as Megatron does")
    return padded


def _pipeline(f: Fields, layers: int, pp: int) -> dict:
    per_chunk = f.get("--num-layers-per-virtual-pipeline-stage", int, 0, ir="strategy.pipeline.virtual_stages")
    vpp = f.get("--num-virtual-stages-per-pipeline-rank", int, 0, ir="strategy.pipeline.virtual_stages")
    if per_chunk and vpp:
        raise f.error("--num-virtual-stages-per-pipeline-rank", "given together with "
                      "--num-layers-per-virtual-pipeline-stage; Megatron accepts only one of them")
    if per_chunk:
        if layers % (pp * per_chunk):
            raise f.error("--num-layers-per-virtual-pipeline-stage", f"{per_chunk} does not divide the "
                          f"{layers // pp} layers of each of the {pp} stages")
        vpp = layers // pp // per_chunk
    vpp = vpp or 1
    pipe: dict = {"schedule": "interleaved_1f1b" if vpp > 1 else "1f1b", "virtual_stages": vpp}
    first = f.get("--decoder-first-pipeline-num-layers", int, 0, ir="strategy.pipeline.layer_split")
    last = f.get("--decoder-last-pipeline-num-layers", int, 0, ir="strategy.pipeline.layer_split")
    if (first or last) and pp > 1:
        if vpp > 1:
            raise f.error("--decoder-first-pipeline-num-layers", "uneven first/last stages with virtual "
                          "pipeline stages are not supported by this conversion; give an even split")
        middle = layers - first - last
        inner = pp - (1 if first else 0) - (1 if last else 0)
        if inner and middle % inner:
            raise f.error("--decoder-first-pipeline-num-layers", f"the {middle} remaining layers do not divide "
                          f"evenly over the {inner} middle stages")
        each = middle // inner if inner else 0
        split = [each] * pp
        if first:
            split[0] = first
        if last:
            split[-1] = last
        pipe["layer_split"] = split
    return pipe


def _zero(f: Fields, dp: int | None) -> dict:
    distopt = f.get("--use-distributed-optimizer", bool, False, ir="strategy.zero.stage")
    fsdp = f.get("--use-torch-fsdp2", bool, False, ir="strategy.zero.stage")
    if distopt and fsdp:
        raise f.error("--use-torch-fsdp2", "cannot be combined with --use-distributed-optimizer (Megatron "
                                           "rejects it); keep one")
    zero = {"stage": 3 if fsdp else 1 if distopt else 0}
    instances = f.get("--num-distributed-optimizer-instances", int, 1, ir="strategy.zero.shard_size")
    if instances > 1:
        if dp is None:
            raise f.error("--num-distributed-optimizer-instances", "needs the world size to know dp; pass "
                                                                   "--world-size N")
        if dp % instances:
            raise f.error("--num-distributed-optimizer-instances", f"{instances} does not divide dp = {dp}")
        zero["shard_size"] = dp // instances
    return zero


def _recompute(f: Fields, warnings: list[str]) -> dict:
    granularity = f.get("--recompute-granularity", ("full", "selective"), None, ir="strategy.recompute.policy")
    if f.get("--recompute-activations", bool, False, ir="strategy.recompute.policy"):
        granularity = "selective"
    if granularity is None:
        return {}
    if granularity == "selective":
        modules = f.data.get("--recompute-modules", "core_attn")
        f.used.add("--recompute-modules")
        modules = " ".join(modules) if isinstance(modules, list) else modules
        warnings.append(f"selective recompute ({modules}): ms_llm's selective policy recomputes the attention "
                        "core and the MLP activation")
        return {"policy": "selective"}
    method = f.get("--recompute-method", ("uniform", "block"), None, ir="strategy.recompute.num_layers")
    n = f.get("--recompute-num-layers", int, 1, ir="strategy.recompute.num_layers")
    if method is None:
        raise f.error("--recompute-granularity", "full needs --recompute-method uniform|block (Megatron refuses "
                                                 "it without)")
    if method == "block":
        return {"policy": "full", "num_layers": n}
    if n != 1:
        warnings.append(f"--recompute-method uniform --recompute-num-layers {n}: Megatron keeps one input per "
                        f"{n} layers; ms_llm keeps one per layer (a little more memory)")
    return {"policy": "full"}


def _precision(f: Fields, warnings: list[str]) -> dict:
    bf16 = f.get("--bf16", bool, False, ir="strategy.precision")
    fp16 = f.get("--fp16", bool, False, ir="strategy.precision")
    if bf16 and fp16:
        raise f.error("--fp16", "given together with --bf16; pick one")
    if f.has("--fp8-format"):
        warnings.append(f"--fp8-format {f.get('--fp8-format', str)}: fp8 matmuls are not modelled; "
                        f"{'bf16' if bf16 else 'fp16' if fp16 else 'fp32'} is kept")
    if not (bf16 or fp16):
        return {"param_dtype": "float32", "compute_dtype": "float32", "master_dtype": "float32",
                "grad_reduce_dtype": "float32"}
    dtype = "bfloat16" if bf16 else "float16"
    reduce = "bfloat16" if f.get("--grad-reduce-in-bf16", bool, False, ir="strategy.precision.grad_reduce_dtype") \
        else "float32"
    prec = {"param_dtype": dtype, "compute_dtype": dtype, "master_dtype": "float32", "grad_reduce_dtype": reduce}
    if fp16:
        if f.has("--loss-scale"):
            prec.update(loss_scale="static", initial_loss_scale=f.get("--loss-scale", float))
        else:
            prec.update(loss_scale="dynamic",
                        initial_loss_scale=f.get("--initial-loss-scale", float, 2.0 ** 32,
                                                 ir="strategy.precision.initial_loss_scale"))
    return prec


def _data(f: Fields, warnings: list[str]) -> dict:
    """--data-path (prefixes, or weight prefix pairs), --split and --tokenizer-model -> train.data."""
    data: dict = {"split": f.get("--split", str, "969,30,1", ir="train.data.split").replace(" ", "")}
    if f.has("--tokenizer-model") and f.raw("--tokenizer-model") is not True:
        data["tokenizer"] = f.get("--tokenizer-model", str, ir="train.data.tokenizer")
    words = f.raw("--data-path", ir="train.data.paths")
    if words is True:
        warnings.append("--data-path has no value (an unset shell variable?); train.data.paths left empty")
        return data
    words = [words] if isinstance(words, str) else words or []
    numbers = [_is_number(w) for w in words]
    if not any(numbers):
        data["paths"] = words
    elif len(words) % 2 == 0 and numbers == [True, False] * (len(words) // 2):
        data.update(paths=words[1::2], weights=[float(w) for w in words[0::2]])
    else:
        raise f.error("--data-path", f"got {' '.join(words)!r}; expected prefixes, or weight prefix pairs")
    return data


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _train(f: Fields, dp: int | None, warnings: list[str]) -> dict:
    mbs = f.get("--micro-batch-size", int, None, ir="train.micro_batch_size")
    if mbs is None:
        mbs = 1
        warnings.append("--micro-batch-size not set; using 1")
    gbs = f.get("--global-batch-size", int, None, ir="train.global_batch_size")
    if gbs is None:
        if dp is None:
            raise f.error("--global-batch-size", "not set, and Megatron's default (micro batch * dp) needs the "
                                                 "world size; pass --world-size N")
        gbs = mbs * dp
    elif dp and gbs % (mbs * dp):
        raise f.error("--global-batch-size", f"{gbs} is not a multiple of micro batch * dp = {mbs}*{dp}; "
                                             "Megatron refuses it")
    if f.has("--rampup-batch-size"):
        ramp = f.get("--rampup-batch-size", list)
        warnings.append(f"--rampup-batch-size {' '.join(ramp)}: batch ramp-up is not modelled; the final "
                        f"global batch {gbs} is used throughout")
    steps = f.get("--train-iters", int, None, ir="train.steps")
    if steps is None and f.has("--train-samples"):
        steps = f.get("--train-samples", int) // gbs
        warnings.append(f"--train-samples read as {steps} steps of {gbs} sequences")
    lr = f.get("--lr", float, 3e-4, ir="train.optimizer.lr")
    optimizer = f.get("--optimizer", ("adam", "sgd"), "adam", ir="train.optimizer.name")
    opt: dict = {"name": "adamw" if optimizer == "adam" else "sgd", "lr": lr,
                 "weight_decay": f.get("--weight-decay", float, 0.01, ir="train.optimizer.weight_decay"),
                 "beta1": f.get("--adam-beta1", float, 0.9, ir="train.optimizer.beta1"),
                 "beta2": f.get("--adam-beta2", float, 0.999, ir="train.optimizer.beta2"),
                 "eps": f.get("--adam-eps", float, 1e-8, ir="train.optimizer.eps"),
                 "grad_clip": f.get("--clip-grad", float, 1.0, ir="train.optimizer.grad_clip")}
    if optimizer == "sgd" and f.get("--sgd-momentum", float, 0.9):
        warnings.append("--optimizer sgd with momentum: ms_llm's SGD has no momentum")
    style = f.get("--lr-decay-style", str, "linear", ir="train.schedule.decay")
    if style not in DECAY_STYLES:
        warnings.append(f"--lr-decay-style {style}: not modelled; cosine decay is used")
    decay_iters = f.get("--lr-decay-iters", int, steps)
    if f.has("--lr-decay-samples"):
        decay_iters = f.get("--lr-decay-samples", int) // gbs
    if steps is not None and decay_iters != steps:
        warnings.append(f"the learning rate decays over {decay_iters} steps, the run has {steps}; ms_llm decays "
                        "over the whole run")
    warmup = f.get("--lr-warmup-iters", int, 0, ir="train.schedule.warmup_steps")
    if f.has("--lr-warmup-fraction"):
        warmup = round(f.get("--lr-warmup-fraction", float) * (decay_iters or 0))
    if f.has("--lr-warmup-samples"):
        warmup = f.get("--lr-warmup-samples", int) // gbs
    schedule = {"warmup_steps": warmup, "decay": DECAY_STYLES.get(style, "cosine"),
                "min_lr_ratio": f.get("--min-lr", float, 0.0, ir="train.schedule.min_lr_ratio") / lr if lr else 0.0}
    saving, load = f.has("--save"), f.data.get("--load")
    f.used.update(("--save", "--load"))
    interval = f.get("--save-interval", int, 0, ir="train.checkpoint.interval")
    if interval and not saving:
        warnings.append(f"--save-interval {interval} without --save: Megatron saves nothing; checkpointing off")
    checkpoint: dict = {"interval": interval if saving else 0,
                        "async_save": f.get("--async-save", bool, False, ir="train.checkpoint.async_save")}
    if isinstance(load, str):
        checkpoint["load"] = load
    if f.has("--ckpt-format"):
        warnings.append(f"--ckpt-format {f.get('--ckpt-format', str)}: ms_llm writes its own sharded "
                        "safetensors format")
    train = {"global_batch_size": gbs, "micro_batch_size": mbs, "seq_len": f.get("--seq-length", int),
             "data": _data(f, warnings),
             "seed": f.get("--seed", int, 1234, ir="train.seed"),
             "log_every": f.get("--log-interval", int, 100, ir="train.log_every"),
             "optimizer": opt, "schedule": schedule, "checkpoint": checkpoint}
    if steps is not None:
        train["steps"] = steps
    return train


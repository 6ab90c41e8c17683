"""model.moe <-> Megatron-LM's --num-experts and --moe-* flags (megatron-core 0.16's TransformerConfig).

Megatron's router is ms_llm's: softmax after top-k (renormalised) or with --moe-router-pre-softmax
(raw top-k weights); sigmoid scores are always renormalised (top-k > 1);
--moe-router-topk-scaling-factor is routed_scaling_factor; --moe-router-num-groups /
--moe-router-group-topk score a group by its best top_k / group_top_k; --moe-router-enable-expert-bias
with --moe-router-bias-update-rate (sigmoid scores only); --moe-router-load-balancing-type aux_loss /
seq_aux_loss (or both, with one --moe-aux-loss-coeff each); --moe-layer-freq an interval or a 0/1
pattern; the aux-loss coefficient defaults to 0.
"""
from __future__ import annotations

import ast
import shlex

from ms_llm.config.model import ModelConfig
from ms_llm.convert.common import Fields, moe_layers, moe_pattern, num

# --moe-router-load-balancing-type -> the IR coefficient its --moe-aux-loss-coeff sets.
BALANCE = {"aux_loss": "aux_loss_coeff", "seq_aux_loss": "seq_aux_loss_coeff", "global_aux_loss": "aux_loss_coeff",
           "none": None, "sinkhorn": None}


def read_moe(f: Fields, layers: int, ffn: int, warnings: list[str]) -> dict | None:
    """--num-experts and the --moe-* flags -> model.moe (module docstring)."""
    experts = f.get("--num-experts", int, 0, ir="model.moe.num_experts")
    if not experts:
        return None
    width = f.get("--moe-ffn-hidden-size", int, ffn, ir="model.moe.expert_ffn_hidden_size")
    top_k = f.get("--moe-router-topk", int, 2, ir="model.moe.top_k")
    score = f.get("--moe-router-score-function", ("softmax", "sigmoid"), "softmax", ir="model.moe.score_function")
    pre = f.get("--moe-router-pre-softmax", bool, False, ir="model.moe.normalize_top_k")
    moe: dict = {"num_experts": experts, "top_k": top_k, "expert_ffn_hidden_size": -1 if width == ffn else width,
                 "score_function": score, "normalize_top_k": not pre if score == "softmax" else top_k > 1,
                 "z_loss_coeff": f.get("--moe-z-loss-coeff", float, 0.0, ir="model.moe.z_loss_coeff"),
                 "routed_scaling_factor": f.get("--moe-router-topk-scaling-factor", float, 1.0,
                                                ir="model.moe.routed_scaling_factor"),
                 "num_groups": f.get("--moe-router-num-groups", int, 1, ir="model.moe.num_groups") or 1,
                 "group_top_k": f.get("--moe-router-group-topk", int, 1, ir="model.moe.group_top_k") or 1,
                 "expert_bias": f.get("--moe-router-enable-expert-bias", bool, False, ir="model.moe.expert_bias"),
                 "bias_update_rate": f.get("--moe-router-bias-update-rate", float, 1e-3,
                                           ir="model.moe.bias_update_rate")}
    if moe["expert_bias"] and score != "sigmoid":
        raise f.error("--moe-router-enable-expert-bias", "needs --moe-router-score-function sigmoid (Megatron refuses "
                                                         "the expert bias with softmax scores)")
    if moe["num_groups"] > 1 and score == "softmax" and not pre:
        warnings.append("--moe-router-num-groups with softmax after top-k: Megatron scores the groups on the router "
                        "logits; ms_llm scores them on the softmax probabilities (the same choice only by chance)")
    moe.update(_balance(f, warnings))
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
    f.accept_usual({"--moe-grouped-gemm": None, "--moe-token-dispatcher-type": None, "--moe-router-dtype": None,
                    "--moe-permute-fusion": None, "--moe-router-fusion": None})
    if f.has("--moe-layer-freq"):
        moe.update(_moe_layer_pattern(f, layers))
    return moe


def _balance(f: Fields, warnings: list[str]) -> dict:
    """--moe-router-load-balancing-type (one type or several) and one --moe-aux-loss-coeff each."""
    kinds = f.raw("--moe-router-load-balancing-type", "aux_loss", ir="model.moe.aux_loss_coeff")
    coeffs = f.raw("--moe-aux-loss-coeff", "0.0", ir="model.moe.aux_loss_coeff")
    kinds, coeffs = ([x] if isinstance(x, str) else x for x in (kinds, coeffs))
    if len(kinds) != len(coeffs) or any(k not in BALANCE for k in kinds):
        raise f.error("--moe-router-load-balancing-type", f"{' '.join(kinds)} with --moe-aux-loss-coeff "
                      f"{' '.join(coeffs)}: expected types among {', '.join(BALANCE)}, one coefficient each")
    out = {"aux_loss_coeff": 0.0, "seq_aux_loss_coeff": 0.0}
    for kind, text in zip(kinds, coeffs):
        try:
            coeff = float(text)
        except ValueError:
            raise f.error("--moe-aux-loss-coeff", f"got {text!r}; expected a number") from None
        if BALANCE[kind] is None:
            if kind == "sinkhorn":
                warnings.append("--moe-router-load-balancing-type sinkhorn (S-BASE balancing) is not modelled; "
                                "read without a balance loss")
            continue
        if kind == "global_aux_loss":
            warnings.append("--moe-router-load-balancing-type global_aux_loss (over the global batch) is not "
                            "expressible; read as the micro-batch loss, model.moe.aux_loss_coeff")
        out[BALANCE[kind]] += coeff
    return out


def _moe_layer_pattern(f: Fields, layers: int) -> dict:
    """--moe-layer-freq N, or a pattern such as "([0]*3+[1]*29)" -> layer_freq, first_dense_layers
    and dense_layers (common.moe_layers)."""
    text = f.get("--moe-layer-freq", str, ir="model.moe.layer_freq")
    if "[" not in text:
        return {"layer_freq": f.get("--moe-layer-freq", int)}
    pattern = _list_expression(f, text)
    if len(pattern) != layers or set(pattern) - {0, 1} or 1 not in pattern:
        raise f.error("--moe-layer-freq", f"{text!r} is not a 0/1 flag for each of the {layers} layers "
                                          "with at least one MoE layer")
    return moe_layers(pattern)


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


def write_moe(m: ModelConfig, warnings: list[str]) -> list[str]:
    """model.moe as read_moe reads it back."""
    moe = m.moe
    if moe is None:
        return []
    out = [f"--num-experts {moe.num_experts}", f"--moe-router-topk {moe.top_k}",
           f"--moe-ffn-hidden-size {m.expert_ffn_size}"]
    if moe.score_function == "sigmoid":
        out.append("--moe-router-score-function sigmoid")
        if not moe.normalize_top_k and moe.top_k > 1:
            warnings.append("model.moe.normalize_top_k = False: Megatron renormalises sigmoid top-k weights; "
                            "written as it does")
    elif not moe.normalize_top_k:
        out.append("--moe-router-pre-softmax")
    elif moe.num_groups > 1:
        warnings.append("model.moe.num_groups: Megatron's softmax-after-top-k router scores groups on the logits, "
                        "ms_llm on the probabilities; written as Megatron's")
    if moe.routed_scaling_factor != 1.0:
        out.append(f"--moe-router-topk-scaling-factor {num(moe.routed_scaling_factor)}")
    if moe.num_groups > 1:
        out += [f"--moe-router-num-groups {moe.num_groups}", f"--moe-router-group-topk {moe.group_top_k}"]
    if moe.expert_bias and moe.score_function == "sigmoid":
        out += ["--moe-router-enable-expert-bias", f"--moe-router-bias-update-rate {num(moe.bias_update_rate)}"]
    elif moe.expert_bias:
        warnings.append("model.moe.expert_bias = True: Megatron takes the expert bias with sigmoid scores only; "
                        "not written")
    out += _write_balance(moe)
    if moe.z_loss_coeff:
        out.append(f"--moe-z-loss-coeff {num(moe.z_loss_coeff)}")
    if moe.shared_experts:
        out.append(f"--moe-shared-expert-intermediate-size {moe.shared_experts * m.expert_ffn_size}")
    if moe.capacity_factor > 0:
        out += [f"--moe-expert-capacity-factor {num(moe.capacity_factor)}", "--moe-token-drop-policy position"]
    if moe.first_dense_layers and moe.layer_freq == 1 and not moe.dense_layers:
        out.append(f"--moe-layer-freq '[0]*{moe.first_dense_layers}+[1]*{m.num_layers - moe.first_dense_layers}'")
    elif moe.first_dense_layers or moe.dense_layers:
        out.append(f"--moe-layer-freq {shlex.quote(str(moe_pattern(m)).replace(' ', ''))}")
    elif moe.layer_freq > 1:
        out.append(f"--moe-layer-freq {moe.layer_freq}")
    return out


def _write_balance(moe) -> list[str]:
    kinds = [(k, c) for k, c in (("aux_loss", moe.aux_loss_coeff), ("seq_aux_loss", moe.seq_aux_loss_coeff)) if c]
    if len(kinds) == 2:
        return ["--moe-router-load-balancing-type aux_loss seq_aux_loss",
                f"--moe-aux-loss-coeff {num(moe.aux_loss_coeff)} {num(moe.seq_aux_loss_coeff)}"]
    if kinds and kinds[0][0] == "seq_aux_loss":
        return ["--moe-router-load-balancing-type seq_aux_loss", f"--moe-aux-loss-coeff {num(kinds[0][1])}"]
    return [f"--moe-aux-loss-coeff {num(moe.aux_loss_coeff)}"]

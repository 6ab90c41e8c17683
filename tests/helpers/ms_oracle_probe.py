"""Build MindFormers' real LlamaForCausalLM for each parallel config and print every
primitive's shard strategy as JSON: the oracle tests/mindspore/test_ms_oracle.py compares our lowering with.

Run in its own interpreter with PYTHONPATH=.oracles (see test_ms_oracle.py): MindFormers'
pinned packages and the semi_auto_parallel context must not leak into the pytest process.
MindSpore refuses to compile semi_auto_parallel on CPU, so the models are only built: shard()
records each strategy on its primitive at construction, which is all that is read here.

Input (argv[1]): a JSON list of {"name", "devices", "parallel": TransformerOpParallelConfig
kwargs, "model": LlamaConfig kwargs}. Output (stdout, last line): {"mindformers": version,
"cases": {name: {cell path + "." + attribute: {"prim", "in", "out"[, "attrs"]}}}, "params": {name:
{parameter name: {"shape", "parallel_optimizer"}}}}, where a strategy is a list of per-input split lists,
or, for a Layout, {"device_matrix", "tensor_map"} per input; "params" are the trainable parameters, with
the flag that keeps one out of MindSpore's parallel optimizer.
"""
from __future__ import annotations

import json
import sys

import mindspore as ms


def _strategy(value) -> list | None:
    """A shard strategy as JSON: tuples of ints stay lists; Layout dicts keep matrix and map."""
    if value is None:
        return None
    out = []
    for item in value:
        if isinstance(item, dict):
            out.append({"device_matrix": list(item["device_matrix"]),
                        "tensor_map": [list(t) if isinstance(t, (tuple, list)) else t for t in item["tensor_map"]]})
        else:
            out.append([int(s) for s in item])
    return out


# Attributes of FlashAttentionScore recorded beside its strategy: how MindFormers builds the
# kernel, and the ring-attention switches its FlashAttention adds (use_ring_attention).
FLASH_ATTRS = ("head_num", "scale_value", "pre_tokens", "next_tokens", "keep_prob", "inner_precise", "sparse_mode",
               "enable_ring_attention", "enable_ra_send_recv")


def _record(prim: ms.ops.Primitive) -> dict | None:
    attrs = prim.attrs
    ins = attrs.get("in_layout") or attrs.get("in_strategy")
    if ins is None:
        return None
    outs = attrs.get("out_layout") or attrs.get("out_strategy")
    record = {"prim": prim.name, "in": _strategy(ins), "out": _strategy(outs)}
    if prim.name == "FlashAttentionScore":
        record["attrs"] = {k: attrs[k] for k in FLASH_ATTRS if k in attrs}
    return record


def build(case: dict) -> tuple[dict, dict]:
    """One config: set the context, build the model, read every sharded primitive and parameter."""
    from mindformers import LlamaConfig, LlamaForCausalLM
    from mindformers.modules.transformer.transformer import TransformerOpParallelConfig

    ms.reset_auto_parallel_context()
    parallel = dict(case["parallel"])
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=case["devices"], full_batch=True,
                                 pipeline_stages=parallel.get("pipeline_stage", 1))
    pc = TransformerOpParallelConfig(**parallel)
    net = LlamaForCausalLM(LlamaConfig(parallel_config=pc, batch_size=1, **case["model"]))
    found = {}
    for name, cell in net.cells_and_names():
        for attr, prim in vars(cell).items():
            if isinstance(prim, ms.ops.Primitive):
                rec = _record(prim)
                if rec is not None:
                    found[f"{name}.{attr}" if name else attr] = rec
    params = {p.name: {"shape": list(p.shape), "parallel_optimizer": bool(p.parallel_optimizer)}
              for p in net.trainable_params()}
    return found, params


def main(cases: list[dict]) -> dict:
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    import mindformers
    import mindformers.modules.transformer.op_parallel_config as opc

    devices = {"n": 1}
    # MindFormers checks the degrees against get_group_size(), which is 1 without a cluster.
    opc.D.get_group_size = lambda *a, **k: devices["n"]
    out, params = {}, {}
    for case in cases:
        devices["n"] = case["devices"]
        out[case["name"]], params[case["name"]] = build(case)
    return {"mindformers": mindformers.__version__, "cases": out, "params": params}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    sys.stdout.write("\n" + json.dumps(result) + "\n")

"""Build MindFormers 2.1's own DeepSeek-V3 training graph (TrainingDeepseekV3ForCausalLM, the
parallel_core/training_graph model) for each parallel config and print every primitive's shard
strategy and the pipeline stage of its top cells as JSON: the oracle tests/mindspore/test_ms_oracle.py
compares ms_llm's DeepSeek lowering with.

Run in its own interpreter with PYTHONPATH=.oracles. The training-graph model asks the communication
layer for its rank, the world size and process groups while it is built (initialize_model_parallel,
the tensor-parallel embedding's group, the MoE layer's groups); with no cluster these answer as rank
0 of the config's device count, and group creation is a no-op: nothing is ever compiled or run, the
build only records each shard() (Layouts over MindFormers' (dp, cp, tp) and MoE (dp_ex_ep, ep) device
matrices), which is what is read here. MindFormers' layout managers are singletons caching the first
config's degrees, so they are reset between configs.

Input (argv[1]): a JSON list of {"name", "devices", "stages", "yaml": MindFormers 2.x YAML text}.
Output (stdout, last line): {"mindformers": version, "cases": {name: {"ops": {cell path + "." + attribute:
{"prim", "in", "out"}}, "stages": {cell path: pipeline_stage}}}}; a strategy is a list per input of split
lists or {"device_matrix", "tensor_map"}, [] for a scalar input (an empty Layout).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import mindspore as ms
import mindspore.communication as comm
import mindspore.communication.management as management

DEVICES = {"n": 1}


def _fake_cluster() -> None:
    """Rank 0 of DEVICES["n"]; groups are names only. Patched before MindFormers imports these names."""
    for module in (comm, management):
        module.create_group = lambda *args, **kwargs: None
        module.get_rank = lambda *args, **kwargs: 0
        module.get_group_size = lambda *args, **kwargs: DEVICES["n"]


def _layout(item) -> dict | list:
    if not item["tensor_map"]:
        return []                                        # layout(): a scalar input
    return {"device_matrix": list(item["device_matrix"]),
            "tensor_map": [list(t) if isinstance(t, (tuple, list)) else t for t in item["tensor_map"]]}


def _strategy(value) -> list | None:
    """A shard strategy as JSON, one entry per tensor input; Concat's tuple input is flattened."""
    if value is None:
        return None
    out = []
    for item in value:
        if isinstance(item, dict):
            out.append(_layout(item))
        elif item and all(isinstance(x, dict) for x in item):
            out += [_layout(x) for x in item]
        else:
            out.append([int(s) for s in item])
    return out


def build(case: dict) -> dict:
    from mindformers.core.context.build_context import MFContextOperator
    from mindformers.core.parallel_config import build_parallel_config
    from mindformers.models.build_config import get_model_config
    from mindformers.models.deepseek3.modeling_deepseek_v3_train import TrainingDeepseekV3ForCausalLM
    from mindformers.parallel_core.training_graph import device_matrix
    from mindformers.tools.register import MindFormerConfig

    DEVICES["n"] = case["devices"]
    for manager in (device_matrix.layout, device_matrix.layout_moe):
        manager._layout = manager._layout_type = manager._config = None
    path = Path(f"{case['name']}.yaml")
    path.write_text(case["yaml"])
    cfg = MindFormerConfig(str(path))
    MFContextOperator.reset_instance()
    MFContextOperator(cfg)
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=case["devices"], full_batch=True,
                                 pipeline_stages=case["stages"])
    build_parallel_config(cfg)
    net = TrainingDeepseekV3ForCausalLM(get_model_config(cfg.model, default_args={"parallel_config": cfg.parallel_config}))
    ops, stages = {}, {}
    for name, cell in net.cells_and_names():
        if name.count(".") <= 3 and getattr(cell, "pipeline_stage", None) is not None:
            stages[name] = cell.pipeline_stage
        for attr, prim in vars(cell).items():
            if not isinstance(prim, ms.ops.Primitive):
                continue
            attrs = prim.attrs
            ins = attrs.get("in_layout") or attrs.get("in_strategy")
            if ins is not None:
                ops[f"{name}.{attr}"] = {"prim": prim.name, "in": _strategy(ins),
                                         "out": _strategy(attrs.get("out_layout") or attrs.get("out_strategy"))}
    return {"ops": ops, "stages": stages}


def main(cases: list[dict]) -> dict:
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    _fake_cluster()
    import mindformers
    from mindformers.parallel_core.inference import parallel_state

    parallel_state._is_initialized = lambda: True
    parallel_state.get_rank = lambda *args, **kwargs: 0
    parallel_state.get_group_size = lambda *args, **kwargs: DEVICES["n"]
    parallel_state.create_group = lambda *args, **kwargs: None
    return {"mindformers": mindformers.__version__, "cases": {c["name"]: build(c) for c in cases}}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    sys.stdout.write("\n" + json.dumps(result) + "\n")

"""megatron_config_probe.py, deepspeed_config_probe.py and torchtitan_config_probe.py in one process
(PYTHONPATH=.oracles): the three peers share torch, whose import is most of each probe's cost.

argv[1]: a JSON file {"megatron": cases, "deepspeed": cases, "torchtitan": cases}, each as its probe
takes them; argv[2]: JSON out, {peer: that probe's out}.
"""
from __future__ import annotations

import json
import os
import sys

import deepspeed_config_probe
import megatron_config_probe
import torchtitan_config_probe

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cuda")         # as deepspeed_config_probe.py runs alone
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    probes = {"megatron": megatron_config_probe, "deepspeed": deepspeed_config_probe,
              "torchtitan": torchtitan_config_probe}
    with open(sys.argv[2], "w") as f:
        json.dump({peer: probes[peer].main(peer_cases) for peer, peer_cases in cases.items()}, f)

"""The peers' training checkpoints that torch pickles or torch DCP hold (Megatron-LM, DeepSpeed,
torchtitan) <-> ms_llm checkpoints: one module per format, each with detect / read_run / write_run
(ms_llm/checkpoint/interop/peers.py lists them)."""

"""MindSpore-side peers' training checkpoints <-> ms_llm: MindFormers (mindformers.py), with detect /
read_run / write_run as ms_llm/checkpoint/interop/peers.py lists them."""

"""Other frameworks' checkpoints <-> ours: Hugging Face safetensors (hf.py, Mixtral's per-expert
tensors in hf_moe.py) and the parameter-name tables of MindSpore and Megatron (names.py). A new
peer format gets a module here."""

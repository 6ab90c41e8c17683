"""DeepSpeed: its JSON config, read and written (json_config.py)."""

"""Megatron-LM: its launch scripts and argument files (read.py) and a launch script in the style
of Megatron's examples (write.py)."""

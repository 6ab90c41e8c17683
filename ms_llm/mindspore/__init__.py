"""MindSpore backend: the LLaMA model, the lowering of a ModelPlan to auto-parallel, and the
CPU data-parallel runtime under msrun. Everything here imports MindSpore; the core does not."""

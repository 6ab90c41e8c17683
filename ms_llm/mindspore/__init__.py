"""MindSpore backend: the decoder model (LLaMA, Qwen, DeepSeek's multi-latent attention, MoE,
multi-token prediction), the lowering of a ModelPlan to auto-parallel, and the runtime under msrun.

Only the modules that build or run MindSpore objects import it at module level: model, layers,
mla, moe, mtp, optim, step, state, zero, collectives, checkpoint, apply and strategy_file. The rest
import none (lower, lower_mla, lower_moe, op_strategy, layout, support, dry_run, launch, compile_cache; worker
and mindrecord import it inside the functions that run), so the core (ms_llm.backends imports support) and the
launcher lower, check and print a plan on a machine without MindSpore."""

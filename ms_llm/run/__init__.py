"""What every training run shares across backends: the loop (loop.py), its folder, progress and
metrics output, LR schedule, fp16 loss scaling, and checkpointing inside the loop (checkpoints.py:
resume, cadence, the 'auto' interval of interval.py, the /dev/shm tier of memory_tier.py and
its keeper process), built on the checkpoint library."""
from ms_llm.run.folder import RunFolder
from ms_llm.run.loss_scale import LossScaler
from ms_llm.run.lr import lr_at
from ms_llm.run.metrics import MetricsLogger, StepMetrics, StepRate, peak_rss_gb

__all__ = ["RunFolder", "LossScaler", "MetricsLogger", "StepMetrics", "StepRate", "lr_at", "peak_rss_gb"]

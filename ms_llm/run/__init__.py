"""What every training run shares across backends: its folder, progress/metrics output, LR schedule,
fp16 loss scaling."""
from ms_llm.run.folder import RunFolder
from ms_llm.run.loss_scale import LossScaler
from ms_llm.run.lr import lr_at
from ms_llm.run.metrics import MetricsLogger, StepMetrics, StepRate, peak_rss_gb

__all__ = ["RunFolder", "LossScaler", "MetricsLogger", "StepMetrics", "StepRate", "lr_at", "peak_rss_gb"]

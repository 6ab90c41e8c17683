"""The parallel-strategy IR: degrees -> mesh -> per-tensor layouts -> ModelPlan -> cost."""

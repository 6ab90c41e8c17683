"""The job's sections as dataclasses: the model's shape (model.py), the training settings
(train.py), the typed YAML reader they share (schema.py) and Hugging Face config.json <->
ModelConfig (hf.py). The JobConfig that joins them with the strategy is ms_llm/job.py, one
layer up, above the IR it contains."""

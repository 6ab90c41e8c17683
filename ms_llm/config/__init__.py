"""Configuration: model shape, training settings, job YAML."""

"""torchtitan: 0.3 jobs (a registered config plus command-line overrides: args.py, write_job.py)
and v0.2.x TOML (write_toml.py), both read by read.py."""

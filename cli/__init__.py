"""The ``fp8-grpo`` command line (cli/main.py)."""

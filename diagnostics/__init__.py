"""Research diagnostics (mismatch tables, KV attribution, MoE mismatch), built on the trainer's and the engine's own code."""

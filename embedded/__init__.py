"""The embedded demo: the synthetic tasks and their verifiers, the tiny model + tokenizer, the SFT warm start."""

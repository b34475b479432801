"""The acceptance testbed: the proxy target, its corpus and tokenizer (README.md)."""

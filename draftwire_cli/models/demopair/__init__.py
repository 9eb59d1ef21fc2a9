"""The demo model pair: a tokenizer, a target and a distilled draft, built from the standard library."""

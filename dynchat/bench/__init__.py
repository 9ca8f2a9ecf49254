"""Benchmarks: `engine` (every method on held-out prompts, `python -m dynchat bench`) and `app`
(tokens/s the app shows vs the engine alone, `python -m dynchat bench-app`)."""

"""Making what the presets ship: the target's reply corpus, features, EAGLE-3 heads and draft models."""

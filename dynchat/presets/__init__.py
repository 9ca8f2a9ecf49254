"""Presets (models.yaml), where their models come from (package sources), and loading them into an
Engine (runtime.py) that hands out a decoder per mode."""

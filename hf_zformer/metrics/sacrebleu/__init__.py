"""Packaged `evaluate` script for the sacrebleu metric; load it with ``hf_zformer.metrics.load("sacrebleu")``.

This folder is a package only so that setuptools ships it without warnings; ``evaluate`` loads
``sacrebleu.py`` by path and never imports this file.
"""

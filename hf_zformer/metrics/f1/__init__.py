"""Packaged `evaluate` script for the f1 metric; load it with ``hf_zformer.metrics.load("f1")``.

This folder is a package only so that setuptools ships it without warnings; ``evaluate`` loads
``f1.py`` by path and never imports this file.
"""

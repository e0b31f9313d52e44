"""Packaged `evaluate` script for the accuracy metric; load it with ``hf_zformer.metrics.load("accuracy")``.

This folder is a package only so that setuptools ships it without warnings; ``evaluate`` loads
``accuracy.py`` by path and never imports this file.
"""

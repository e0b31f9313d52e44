"""Metrics: ``evaluate`` metrics shipped inside hf_zformer, so they load offline.
May import: evaluate and sacrebleu; nothing else of ``hf_zformer``.

``evaluate.load("sacrebleu")`` downloads the metric script from the Hugging Face Hub; the
modules here are the same metrics (same inputs, options and output keys) as scripts in this
package, loaded with ``evaluate.load(<absolute path of the script>)``, which never touches the
network:

>>> from hf_zformer import metrics
>>> bleu = metrics.load("sacrebleu")
>>> round(bleu.compute(predictions=["the cat sat on the mat"], references=[["the cat sat on the mat"]])["score"], 4)
100.0

Available: ``"sacrebleu"`` (alias ``"bleu"``), ``"accuracy"``, ``"f1"``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import evaluate

__all__ = ["AVAILABLE_METRICS", "load", "metric_path"]

_HERE = Path(__file__).resolve().parent
_ALIASES = {"bleu": "sacrebleu"}

#: Names accepted by :func:`load` (aliases included).
AVAILABLE_METRICS: tuple[str, ...] = ("sacrebleu", "bleu", "accuracy", "f1")


def metric_path(name: str) -> Path:
    """Absolute path of the packaged ``evaluate`` script for metric ``name`` (aliases allowed).

    Raises ``ValueError`` naming the available metrics when ``name`` is unknown.
    """
    canonical = _ALIASES.get(name, name)
    script = _HERE / canonical / f"{canonical}.py"
    if name not in AVAILABLE_METRICS or not script.is_file():
        raise ValueError(f"Unknown metric {name!r}; available: {', '.join(AVAILABLE_METRICS)}")
    return script


def load(name: str, **kwargs: Any) -> evaluate.EvaluationModule:
    """Load a packaged metric as an ``evaluate`` module, without network access.

    Args:
        name: ``"sacrebleu"`` (alias ``"bleu"``: SacreBLEU, *not* the Hub's ``bleu`` module),
            ``"accuracy"`` or ``"f1"``.
        **kwargs: passed to :func:`evaluate.load`, e.g. ``num_process``/``process_id`` and
            ``experiment_id`` for distributed evaluation, or ``keep_in_memory=True``.

    Returns:
        the ``evaluate.EvaluationModule``; use ``compute(...)`` or ``add_batch(...)`` then ``compute()``.
    """
    return evaluate.load(str(metric_path(name)), **kwargs)

"""Classification accuracy as an ``evaluate`` metric that loads from this package, offline.

Same inputs, options and output as the Hub's ``evaluate-metric/accuracy`` module (single-label).
Load it with ``hf_zformer.metrics.load("accuracy")``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
Accuracy is the proportion of correct predictions among all predictions:
(sum of weights of correct predictions) / (sum of all weights), every weight being 1 by default.
"""

_CITATION = ""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool): if True (default) return the fraction of correct predictions, else their
        (weighted) number.
    sample_weight (list of float): one weight per sample. Default None (all 1).
Returns:
    accuracy (float): fraction correct in [0, 1] if normalize, else the weighted count of correct ones.
Example:
    >>> from hf_zformer import metrics
    >>> metrics.load("accuracy").compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions = np.asarray(predictions, dtype=np.int64)
        references = np.asarray(references, dtype=np.int64)
        if predictions.shape != references.shape:
            raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
        if sample_weight is None:
            weights = np.ones(len(predictions), dtype=np.float64)
        else:
            weights = np.asarray(sample_weight, dtype=np.float64)
            if weights.shape != predictions.shape:
                raise ValueError(f"sample_weight has {weights.size} values for {predictions.size} samples")
        correct = float(np.sum(weights * (predictions == references)))
        if not normalize:
            return {"accuracy": correct}
        total = float(np.sum(weights))
        if total == 0:
            raise ValueError("accuracy is undefined: no samples (or all sample weights are 0)")
        return {"accuracy": correct / total}

"""F1 score as an ``evaluate`` metric that loads from this package, offline.

Same inputs, options and results as the Hub's ``evaluate-metric/f1`` module (scikit-learn's
``f1_score`` semantics, single-label), implemented with numpy only. Load it with
``hf_zformer.metrics.load("f1")``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
The F1 score is the harmonic mean of precision and recall: F1 = 2 * TP / (2 * TP + FP + FN).
A class with no true positives, false positives or false negatives gets F1 = 0.
"""

_CITATION = ""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    labels (list of int): the labels to score (and their order for average=None). Default: every
        label in predictions or references, sorted. Ignored for average="binary".
    pos_label (int): the positive class for average="binary". Default 1.
    average (str or None): "binary" (default; F1 of pos_label, data must have at most 2 labels),
        "micro" (from global TP/FP/FN counts), "macro" (unweighted mean over labels), "weighted"
        (mean weighted by each label's number of references), or None (one F1 per label).
    sample_weight (list of float): one weight per sample. Default None (all 1).
Returns:
    f1 (float, or list of float for average=None): in [0, 1].
Example:
    >>> from hf_zformer import metrics
    >>> metrics.load("f1").compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'f1': 0.6666666666666666}
"""

_AVERAGES = ("binary", "micro", "macro", "weighted", None)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        if average not in _AVERAGES:
            raise ValueError(f"average must be one of {list(_AVERAGES)}, got {average!r}")
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

        present = np.unique(np.concatenate([predictions, references]))
        if average == "binary":
            if len(present) > 2:
                raise ValueError(
                    f"average='binary' needs at most 2 labels, but the data has {len(present)}: "
                    f"{present.tolist()}; choose average='micro', 'macro' or 'weighted'"
                )
            if len(present) == 2 and pos_label not in present:
                raise ValueError(
                    f"pos_label={pos_label!r} is not a valid label: it should be one of {present.tolist()}"
                )
            scored = np.asarray([pos_label], dtype=np.int64)
        else:
            scored = present if labels is None else np.asarray(labels, dtype=np.int64)

        # weighted true-positive / predicted / true counts for each scored label
        tp = np.array(
            [np.sum(weights * ((predictions == lab) & (references == lab))) for lab in scored], dtype=np.float64
        )
        pred = np.array([np.sum(weights * (predictions == lab)) for lab in scored], dtype=np.float64)
        true = np.array([np.sum(weights * (references == lab)) for lab in scored], dtype=np.float64)

        if average == "micro":
            tp, pred, true = tp.sum(keepdims=True), pred.sum(keepdims=True), true.sum(keepdims=True)
        denominator = pred + true  # = 2 TP + FP + FN
        f1 = np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator > 0)

        if average == "weighted":
            support = true.sum()
            score = float(np.sum(f1 * true) / support) if support > 0 else 0.0
        elif average == "macro":
            score = float(f1.mean()) if f1.size else 0.0
        elif average is None:
            return {"f1": [float(value) for value in f1]}
        else:  # binary, micro
            score = float(f1[0])
        return {"f1": score}

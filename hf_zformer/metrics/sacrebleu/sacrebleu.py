"""SacreBLEU as an ``evaluate`` metric that loads from this package, offline.

Same inputs, options and output keys as the Hub's ``evaluate-metric/sacrebleu`` module; the score
is ``sacrebleu.corpus_bleu`` on the same data. Load it with ``hf_zformer.metrics.load("sacrebleu")``.
"""

import datasets
import evaluate
import sacrebleu

_DESCRIPTION = """\
Corpus-level BLEU computed by SacreBLEU (Post, 2018) with its standard, shareable tokenization and
settings, so that scores are comparable across papers. Scores are on a 0-100 scale.
"""

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    publisher = "Association for Computational Linguistics",
    url = "https://www.aclweb.org/anthology/W18-6319",
    pages = "186--191",
}
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): system outputs, one detokenized string per segment.
    references (list of str, or list of list of str): one reference per prediction, or a list of
        references per prediction (every prediction needs the same number of references).
    smooth_method (str): "none", "floor", "add-k" or "exp" (default).
    smooth_value (float): smoothing value for "floor" and "add-k"; None uses sacrebleu's default.
    tokenize (str): sacrebleu tokenizer ("13a" by default, "intl", "zh", "char", "none", ...).
    lowercase (bool): lowercase before scoring. Default False.
    force (bool): allow already-tokenized input without a warning. Default False.
    use_effective_order (bool): use the effective n-gram order (for sentence-level BLEU). Default False.
Returns:
    score (float): BLEU, 0-100.
    counts (list of int): matching n-gram counts for n = 1..4.
    totals (list of int): hypothesis n-gram counts for n = 1..4.
    precisions (list of float): n-gram precisions (percent).
    bp (float): brevity penalty.
    sys_len (int): hypothesis length in tokens.
    ref_len (int): effective reference length in tokens.
Example:
    >>> from hf_zformer import metrics
    >>> bleu = metrics.load("sacrebleu")
    >>> result = bleu.compute(predictions=["hello there general kenobi"],
    ...                       references=[["hello there general kenobi", "hello there !"]])
    >>> round(result["score"], 1)
    100.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Sacrebleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            homepage="https://github.com/mjpost/sacrebleu",
            codebase_urls=["https://github.com/mjpost/sacrebleu"],
            reference_urls=["https://aclanthology.org/W18-6319"],
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references"),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
        )

    def _compute(
        self,
        predictions,
        references,
        smooth_method="exp",
        smooth_value=None,
        force=False,
        lowercase=False,
        tokenize=None,
        use_effective_order=False,
    ):
        references = [[ref] if isinstance(ref, str) else list(ref) for ref in references]
        n_refs = {len(refs) for refs in references}
        if len(n_refs) > 1:
            raise ValueError(
                f"sacrebleu needs the same number of references for every prediction; got counts {sorted(n_refs)}"
            )
        if n_refs == {0}:
            raise ValueError("every prediction needs at least one reference")
        # sacrebleu wants one stream per reference position: streams[k][i] = k-th reference of segment i
        streams = [list(column) for column in zip(*references)] if references else [[]]
        options = {"tokenize": tokenize} if tokenize is not None else {}
        result = sacrebleu.corpus_bleu(
            list(predictions),
            streams,
            smooth_method=smooth_method,
            smooth_value=smooth_value,
            force=force,
            lowercase=lowercase,
            use_effective_order=use_effective_order,
            **options,
        )
        return {
            "score": result.score,
            "counts": result.counts,
            "totals": result.totals,
            "precisions": result.precisions,
            "bp": result.bp,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
        }

"""Data: dataset loaders for translation, text classification and language modelling.
May import: datasets and the standard library; nothing else of ``hf_zformer``.

Every loader accepts either a local directory (the layout of ``/work/shared/data``, which works
offline) or a Hugging Face Hub dataset name, and always returns a :class:`datasets.DatasetDict`
with the same schema whatever the source:

* :func:`load_translation_dataset` -> one column ``translation`` holding dicts
  ``{source_lang: str, target_lang: str}`` (feature :class:`datasets.Translation`), the
  convention of the ``transformers`` translation examples and of the WMT datasets on the Hub.
* :func:`load_classification_dataset` -> columns ``text`` (str) and ``label`` (int64), plus any
  ``extra_columns`` asked for.
* :func:`load_text_dataset` -> one column ``text`` (str): documents for language modelling.

Split names are normalised to ``train``, ``validation`` and ``test`` (``val``, ``valid`` and
``dev`` mean ``validation``; Multi30K's ``test_2016_flickr`` means ``test``). When a dataset has
a ``train`` split but no ``validation`` split, a validation split is carved from ``train``
deterministically (seeded; stratified by label for classification).

:func:`dataset_source` is the rule that decides between the local loaders and
:func:`datasets.load_dataset`.

The modules, by job:

* :mod:`.sources` -- local path or Hub id, Hub loading, the reachability check;
* :mod:`.files` -- reading text files, split files of a folder, fingerprints, in-memory datasets;
* :mod:`.records` -- JSON lines / CSV records and their label checks;
* :mod:`.splits` -- split names, validation carving, subsetting;
* :mod:`.translation`, :mod:`.classification`, :mod:`.text` -- the three loaders.
"""

from .classification import load_classification_dataset
from .records import LabelRange
from .sources import dataset_source, hub_unreachable
from .splits import SPLIT_ALIASES
from .text import load_text_dataset
from .translation import load_translation_dataset

__all__ = [
    "LabelRange",
    "SPLIT_ALIASES",
    "dataset_source",
    "hub_unreachable",
    "load_classification_dataset",
    "load_text_dataset",
    "load_translation_dataset",
]

"""Train subword tokenizers that load back as ``transformers`` fast tokenizers.

:func:`train_tokenizer` trains a BPE or Unigram model with the ``tokenizers`` library and
returns a :class:`transformers.PreTrainedTokenizerFast`; saved with ``save_pretrained`` (or
``save_dir=``), it reloads offline with ``AutoTokenizer.from_pretrained(dir)``.

Every tokenizer made here has the same fixed special-token layout:

====  ===========  =========================================
id    token        use
====  ===========  =========================================
0     ``<pad>``    padding (``pad_token_id``)
1     ``<s>``      beginning of sequence (``bos_token_id``)
2     ``</s>``     end of sequence, appended to every encoded sequence (``eos_token_id``)
3     ``<unk>``    characters never seen in training (``unk_token_id``)
4     ``<mask>``   masked-language-model mask (``mask_token_id``)
====  ===========  =========================================

Text pipeline: NFKC normalisation (then lowercasing, for an uncased tokenizer: ``lowercase=True``);
a SentencePiece-style ``Metaspace`` pre-tokenizer (spaces
become ``▁`` and stay part of the pieces, so decoding restores the exact spacing) followed by
isolating punctuation into its own pieces; the matching ``Metaspace`` decoder. Hence
``tok.decode(tok(s).input_ids, skip_special_tokens=True) == unicodedata.normalize("NFKC", s)``
for text whose characters were seen in training (an uncased tokenizer gives its lowercase). Encoding appends ``</s>``:
``"$A </s>"`` for one sequence, ``"$A </s> $B </s>"`` for a pair.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable, Iterator, Sequence

import datasets
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "MASK_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "fits_vocabulary",
    "iter_texts",
    "train_tokenizer",
]

#: Special tokens in id order: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<unk>`` = 3, ``<mask>`` = 4.
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = range(len(SPECIAL_TOKENS))

_METASPACE = "\u2581"  # "▁"
#: Always in the vocabulary, so digits and ASCII punctuation never become ``<unk>``.
_INITIAL_ALPHABET = sorted(set(string.ascii_letters + string.digits + string.punctuation + _METASPACE))


def fits_vocabulary(tokenizer, vocab_size: int) -> bool:
    """Whether ``tokenizer`` can be a model's with ``vocab_size`` embedding rows: no id beyond them, and
    at least half of them covered. transformers 5 builds a tokenizer of the 5 special tokens for a
    folder without tokenizer files, which would turn every word into the unknown token."""
    return vocab_size // 2 <= len(tokenizer) <= vocab_size


def iter_texts(
    data: Iterable[str] | datasets.Dataset | datasets.DatasetDict,
    *,
    split: str = "train",
    text_column: str = "text",
    languages: Sequence[str] | None = None,
    batch_size: int = 1000,
) -> Iterator[str]:
    """Yield the training texts of ``data``.

    * ``DatasetDict``: uses its ``split`` split (``train`` by default: train tokenizers on training
      data only).
    * ``Dataset`` with a ``translation`` column (see :func:`hf_zformer.data.load_translation_dataset`):
      yields every language of every pair (or only ``languages``, in that order), for one joint
      vocabulary.
    * ``Dataset`` otherwise: yields the ``text_column`` column.
    * any other iterable: its items, which must be strings.
    """
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"Split {split!r} not in the DatasetDict (splits: {list(data)})")
        data = data[split]
    if isinstance(data, datasets.Dataset):
        if "translation" in data.column_names:
            for batch in data.select_columns(["translation"]).iter(batch_size=batch_size):
                for pair in batch["translation"]:
                    for lang in languages if languages is not None else pair:
                        if lang not in pair:
                            raise ValueError(f"Language {lang!r} not in the translation pairs (have {sorted(pair)})")
                        yield pair[lang]
        elif text_column in data.column_names:
            for batch in data.select_columns([text_column]).iter(batch_size=batch_size):
                yield from batch[text_column]
        else:
            raise ValueError(
                f"Dataset has neither a 'translation' column nor the text column {text_column!r}; "
                f"its columns are {data.column_names}"
            )
        return
    if isinstance(data, (str, bytes)):
        raise TypeError("Pass an iterable of strings, not a single string")
    for item in data:
        if not isinstance(item, str):
            raise TypeError(f"Training texts must be strings, got {type(item).__name__}: {item!r}")
        yield item


def _build_tokenizer(model: str, vocab_size: int, min_frequency: int, show_progress: bool, lowercase: bool = False):
    alphabet = [c for c in _INITIAL_ALPHABET if c == c.lower()] if lowercase else _INITIAL_ALPHABET  # no unused capitals
    if model == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=alphabet,
            show_progress=show_progress,
        )
    elif model == "unigram":
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            unk_token="<unk>",
            initial_alphabet=alphabet,
            show_progress=show_progress,
        )
    else:
        raise ValueError(f"model must be 'bpe' or 'unigram', got {model!r}")
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]) if lowercase else normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=_METASPACE, prepend_scheme="always"),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.Metaspace(replacement=_METASPACE, prepend_scheme="always")
    return tokenizer, trainer


def train_tokenizer(
    texts: Iterable[str] | datasets.Dataset | datasets.DatasetDict,
    vocab_size: int = 8000,
    model: str = "bpe",
    *,
    min_frequency: int = 2,
    model_max_length: int = 512,
    save_dir: str | os.PathLike | None = None,
    show_progress: bool = False,
    split: str = "train",
    text_column: str = "text",
    lowercase: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a subword tokenizer and return it as a ``transformers`` fast tokenizer.

    Args:
        texts: training text: an iterable of strings, or a ``Dataset``/``DatasetDict`` read with
            :func:`iter_texts` (a translation dataset gives one joint vocabulary for both languages).
        vocab_size: target vocabulary size, special tokens included (BPE may stop below it on
            small data; the learned size is ``len(tokenizer)``).
        model: ``"bpe"`` or ``"unigram"`` (SentencePiece-style unigram language model).
        min_frequency: BPE only: minimum count for a merge.
        model_max_length: stored as ``tokenizer.model_max_length`` (used by ``truncation=True``).
        save_dir: if given, ``save_pretrained`` the tokenizer there.
        show_progress: show the ``tokenizers`` training progress bar.
        split, text_column: passed to :func:`iter_texts`.
        lowercase: an uncased tokenizer: text is lowercased after NFKC, in training and in every
            later encoding (the normalizer is saved with the tokenizer). Fewer pieces spent on case
            variants of a word (``Great``/``great``/``GREAT``), which helps small classifiers
            trained from scratch; decoding gives lowercased text.

    Returns:
        a ``PreTrainedTokenizerFast`` with ``pad=0, bos=1, eos=2, unk=3, mask=4``
        (see :data:`SPECIAL_TOKENS`), ``padding_side="right"``, an ``</s>``-appending post-processor,
        ``model_input_names = ["input_ids", "attention_mask"]`` and
        ``clean_up_tokenization_spaces=False`` (decoding restores the original spacing).
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be an int > {len(SPECIAL_TOKENS)}, got {vocab_size!r}")
    if model_max_length < 1:
        raise ValueError(f"model_max_length must be >= 1, got {model_max_length!r}")
    tokenizer, trainer = _build_tokenizer(model, vocab_size, min_frequency, show_progress, lowercase)

    counter = {"texts": 0, "chars": 0}

    def counted() -> Iterator[str]:
        for text in iter_texts(texts, split=split, text_column=text_column):
            counter["texts"] += 1
            counter["chars"] += len(text.strip())
            yield text

    length = None
    if isinstance(texts, datasets.DatasetDict) and split in texts:
        length = len(texts[split]) * (2 if "translation" in texts[split].column_names else 1)
    elif isinstance(texts, datasets.Dataset):
        length = len(texts) * (2 if "translation" in texts.column_names else 1)
    tokenizer.train_from_iterator(counted(), trainer=trainer, length=length)
    if counter["chars"] == 0:
        raise ValueError("No training text: the input has no non-empty strings")

    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:  # guards the documented layout
            raise RuntimeError(f"Special token {token!r} got id {tokenizer.token_to_id(token)}, expected {token_id}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>",
        pair="$A </s> $B </s>",
        special_tokens=[("</s>", EOS_ID)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_max_length=model_max_length,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
        clean_up_tokenization_spaces=False,
    )
    if save_dir is not None:
        fast.save_pretrained(os.fspath(save_dir))
    return fast

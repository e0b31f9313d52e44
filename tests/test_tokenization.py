"""Tests for hf_zformer.tokenization: training, special-token layout, round trips, reloading."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_zformer.tokenization import (
    BOS_ID,
    EOS_ID,
    MASK_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    iter_texts,
    train_tokenizer,
)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

GERMAN = [
    "Ein Mann mit einem orangefarbenen Hut starrt auf etwas.",
    "Zwei junge Männer spielen Fußball im Park, während es regnet!",
    "Eine Frau in einem blauen Kleid läuft über die Straße.",
    "Drei Kinder sitzen auf einer Bank und essen Äpfel.",
    "Der Hund springt über den Zaun – er ist 3 Jahre alt.",
    "Sie kauft 12 Brötchen für 4,50 Euro; das ist günstig.",
    "Ist das Mädchen (etwa 7 Jahre alt) glücklich?",
    "„Guten Morgen“, sagt der Bäcker um 6:30 Uhr.",
]
ENGLISH = [
    "A man with an orange hat staring at something.",
    "Two young men play soccer in the park, while it's raining!",
    "A woman in a blue dress walks across the street.",
    "Three children sit on a bench and eat apples.",
    "The dog jumps over the fence - he is 3 years old.",
    "She buys 12 rolls for 4.50 euros; that's cheap.",
    'Is the girl (about 7 years old) happy? "Yes," she said.',
    "Good morning, says the baker at 6:30 a.m.",
]


@pytest.fixture(scope="module")
def translation_dict() -> datasets.DatasetDict:
    pairs = [{"de": d, "en": e} for d, e in zip(GERMAN, ENGLISH)] * 5
    features = datasets.Features({"translation": datasets.Translation(languages=["de", "en"])})
    train = datasets.Dataset.from_dict({"translation": pairs}, features=features)
    held_out = datasets.Dataset.from_dict({"translation": [{"de": "Nur hier.", "en": "Only here."}]}, features=features)
    return datasets.DatasetDict({"train": train, "validation": held_out})


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def trained(request, translation_dict, tmp_path_factory) -> tuple[str, PreTrainedTokenizerFast, Path]:
    save_dir = tmp_path_factory.mktemp(f"tok_{request.param}")
    tokenizer = train_tokenizer(
        translation_dict, vocab_size=300, model=request.param, save_dir=save_dir, model_max_length=64
    )
    return request.param, tokenizer, save_dir


def test_iter_texts(translation_dict: datasets.DatasetDict) -> None:
    texts = list(iter_texts(translation_dict))
    assert len(texts) == 2 * len(translation_dict["train"])
    assert texts[:4] == [GERMAN[0], ENGLISH[0], GERMAN[1], ENGLISH[1]]  # both sides, interleaved
    assert list(iter_texts(translation_dict, split="validation")) == ["Nur hier.", "Only here."]
    assert list(iter_texts(translation_dict["validation"], languages=["en"])) == ["Only here."]
    classification = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]})
    assert list(iter_texts(classification)) == ["a", "b"]
    assert list(iter_texts(datasets.Dataset.from_dict({"review": ["r"]}), text_column="review")) == ["r"]
    assert list(iter_texts(iter(["x", "y"]))) == ["x", "y"]
    with pytest.raises(ValueError, match="'test'"):
        list(iter_texts(translation_dict, split="test"))
    with pytest.raises(ValueError, match="'fr'"):
        list(iter_texts(translation_dict, languages=["fr"]))
    with pytest.raises(ValueError, match="review"):
        list(iter_texts(datasets.Dataset.from_dict({"review": ["r"]})))
    with pytest.raises(TypeError, match="strings"):
        list(iter_texts(["ok", 3]))
    with pytest.raises(TypeError, match="single string"):
        list(iter_texts("not a list"))


def test_special_token_layout(trained) -> None:
    _, tokenizer, _ = trained
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID) == (0, 1, 2, 3, 4)
    assert SPECIAL_TOKENS == ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    ids = (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
        tokenizer.mask_token_id,
    )
    assert ids == (0, 1, 2, 3, 4)
    assert 100 < len(tokenizer) <= 300
    assert tokenizer.model_max_length == 64
    assert tokenizer.padding_side == "right"


def test_round_trip_and_eos(trained) -> None:
    model, tokenizer, _ = trained
    for sentence in GERMAN + ENGLISH + ["Männer, Äpfel und 4,50 Euro: günstig!", "It's 6:30 - (about) 12 rolls."]:
        ids = tokenizer(sentence)["input_ids"]
        assert ids[-1] == EOS_ID and ids.count(EOS_ID) == 1, model
        assert UNK_ID not in ids
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded == unicodedata.normalize("NFKC", sentence) == sentence, (model, decoded)
    # spacing of the input is kept exactly, including space before punctuation when it was there
    assert (
        tokenizer.decode(tokenizer("Hallo ! Ein  Mann .")["input_ids"], skip_special_tokens=True)
        == "Hallo ! Ein  Mann ."
    )
    assert tokenizer.decode(tokenizer("Männer")["input_ids"]) == "Männer</s>"
    # NFKC normalisation: the ligature and full-width characters become plain letters
    assert tokenizer.decode(tokenizer("ﬁnd Ａ")["input_ids"], skip_special_tokens=True) == "find A"
    pair = tokenizer("Ein Mann.", "A man.")["input_ids"]
    assert pair.count(EOS_ID) == 2 and pair[-1] == EOS_ID
    assert tokenizer(text_target="A man.")["input_ids"][-1] == EOS_ID


def test_unknown_characters_are_unk(trained) -> None:
    _, tokenizer, _ = trained
    ids = tokenizer("A 猫 man.")["input_ids"]
    assert UNK_ID in ids
    assert tokenizer.decode(ids, skip_special_tokens=True).replace(" ", "") == "Aman."


def test_batch_padding_truncation(trained) -> None:
    _, tokenizer, _ = trained
    batch = tokenizer(["Ein Mann.", GERMAN[1]], padding=True)
    assert set(batch) == {"input_ids", "attention_mask"}  # no token_type_ids
    short, long = batch["input_ids"]
    assert len(short) == len(long) and short[-1] == PAD_ID
    assert batch["attention_mask"][0][short.index(EOS_ID) + 1] == 0
    truncated = tokenizer(" ".join(GERMAN * 5), truncation=True)["input_ids"]
    assert len(truncated) == 64 and truncated[-1] == EOS_ID


def test_reload_with_auto_tokenizer(trained) -> None:
    model, tokenizer, save_dir = trained
    assert (save_dir / "tokenizer.json").is_file()
    reloaded = AutoTokenizer.from_pretrained(save_dir)
    assert isinstance(reloaded, PreTrainedTokenizerFast)
    for sentence in GERMAN + ENGLISH:
        ids = tokenizer(sentence)["input_ids"]
        assert reloaded(sentence)["input_ids"] == ids
        assert reloaded.decode(ids, skip_special_tokens=True) == sentence
    assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (0, 1, 2)
    assert (reloaded.unk_token_id, reloaded.mask_token_id) == (3, 4)
    assert reloaded.model_max_length == 64 and len(reloaded) == len(tokenizer)
    assert reloaded.clean_up_tokenization_spaces is False
    # the saved tokenizer loads with the network forbidden
    offline = AutoTokenizer.from_pretrained(save_dir, local_files_only=True)
    assert offline(ENGLISH[0])["input_ids"] == tokenizer(ENGLISH[0])["input_ids"]


def test_train_from_iterable_and_deterministic() -> None:
    first = train_tokenizer(iter(ENGLISH * 3), vocab_size=150)
    second = train_tokenizer(list(ENGLISH * 3), vocab_size=150)
    assert first.get_vocab() == second.get_vocab()
    assert first(ENGLISH[2])["input_ids"] == second(ENGLISH[2])["input_ids"]
    classification = datasets.Dataset.from_dict({"review": GERMAN, "label": [0, 1] * 4})
    tokenizer = train_tokenizer(classification, vocab_size=150, text_column="review")
    assert tokenizer.decode(tokenizer(GERMAN[3])["input_ids"], skip_special_tokens=True) == GERMAN[3]


def test_lowercase_tokenizer_is_uncased_and_saves_it(tmp_path: Path) -> None:
    """`lowercase=True`: one vocabulary for every casing, in training and after a reload."""
    texts = ENGLISH * 3 + [sentence.upper() for sentence in ENGLISH]
    cased = train_tokenizer(texts, vocab_size=150)
    uncased = train_tokenizer(texts, vocab_size=150, lowercase=True, save_dir=tmp_path / "tok")
    assert not any(piece != piece.lower() for piece in uncased.get_vocab())
    assert any(piece != piece.lower() for piece in cased.get_vocab())
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    for sentence in ENGLISH:
        ids = uncased(sentence)["input_ids"]
        assert uncased(sentence.upper())["input_ids"] == ids == reloaded(sentence.title())["input_ids"]
        assert reloaded.decode(ids, skip_special_tokens=True) == sentence.lower()


def test_train_errors() -> None:
    with pytest.raises(ValueError, match="model must be"):
        train_tokenizer(ENGLISH, model="wordpiece")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(ENGLISH, vocab_size=5)
    with pytest.raises(ValueError, match="No training text"):
        train_tokenizer([], vocab_size=100)
    with pytest.raises(ValueError, match="No training text"):
        train_tokenizer(["", "   "], vocab_size=100)
    with pytest.raises(ValueError, match="model_max_length"):
        train_tokenizer(ENGLISH, model_max_length=0)


@pytest.mark.skipif(not (SHARED_DATA / "multi30k").is_dir(), reason=f"{SHARED_DATA / 'multi30k'} not found")
def test_joint_vocabulary_on_multi30k(tmp_path: Path) -> None:
    from hf_zformer.data import load_translation_dataset

    data = load_translation_dataset(SHARED_DATA / "multi30k")
    tokenizer = train_tokenizer(data, vocab_size=8000, save_dir=tmp_path)
    assert len(tokenizer) == 8000
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    sentences = [text for pair in data["validation"]["translation"][:] for text in (pair["de"], pair["en"])]
    encoded = reloaded(sentences)["input_ids"]
    assert all(ids[-1] == EOS_ID for ids in encoded)
    decoded = reloaded.batch_decode(encoded, skip_special_tokens=True)
    assert decoded == [unicodedata.normalize("NFKC", s) for s in sentences]
    # one joint vocabulary: frequent words of both languages are single pieces
    for word in ("▁Mann", "▁man", "▁Frau", "▁woman"):
        assert word in reloaded.get_vocab()
    mean_length = sum(map(len, encoded)) / len(encoded)
    assert mean_length < 25  # sentences average ~12 words: the subwords are real subwords

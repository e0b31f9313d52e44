"""Tests for hf_zformer.data: local translation/classification loaders, Hub handling, splits."""

from __future__ import annotations

import collections
import csv
import gzip
import json
import sys
from pathlib import Path

import datasets
import pytest

from hf_zformer.data import dataset_source, load_classification_dataset, load_translation_dataset

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
needs_shared_data = pytest.mark.skipif(
    not SHARED_DATA.is_dir(),
    reason=f"shared data directory {SHARED_DATA} not found (CI keeps it beside the clone as ../shared/data)",
)


@pytest.fixture(autouse=True)
def _hub_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub tests here mock ``datasets.load_dataset``; the reachability check must pass too
    (tests/test_first_contact.py covers the check itself)."""
    monkeypatch.setattr("hf_zformer.data.sources.hub_unreachable", lambda timeout=5.0: None)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str], gz: bool | None = None) -> Path:
    text = "".join(line + "\n" for line in lines)
    if gz if gz is not None else path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def make_parallel(directory: Path, stem: str, n: int, gz: bool = True, langs=("de", "en")) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for lang in langs:
        name = f"{stem}.{lang}" + (".gz" if gz else "")
        write_lines(directory / name, [f"{stem} {lang} Satz {i}." for i in range(n)], gz=gz)


@pytest.fixture
def multi30k_like(tmp_path: Path) -> Path:
    root = tmp_path / "m30k"
    make_parallel(root, "train", 40)
    make_parallel(root, "val", 7)
    make_parallel(root, "test_2016_flickr", 5)
    make_parallel(root, "test_2017_mscoco", 3)  # an extra stem, ignored unless mapped
    return root


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def imdb_rows(n_per_label: int) -> list[dict]:
    rows = []
    for i in range(n_per_label):  # sorted by label, like a naive dump of aclImdb
        rows.append({"text": f"great film number {i}", "label": 1, "rating": 9, "id": f"pos_{i}"})
    for i in range(n_per_label):
        rows.append({"text": f"awful film number {i}", "label": 0, "rating": 2, "id": f"neg_{i}"})
    return rows


def column(ds: datasets.Dataset, name: str) -> list:
    """A column as a list (``ds[name]`` is a lazy Column that is slow to iterate row by row)."""
    return ds.select_columns([name])[:][name]


# ---------------------------------------------------------------------------------------------
# dataset_source
# ---------------------------------------------------------------------------------------------


def test_dataset_source(tmp_path: Path) -> None:
    assert dataset_source(tmp_path) == "local"
    file = write_lines(tmp_path / "train.jsonl", ["{}"])
    assert dataset_source(str(file)) == "local"
    assert dataset_source("bentrevett/multi30k") == "hub"
    assert dataset_source("imdb") == "hub"
    for local_looking in [tmp_path / "missing", "./data/imdb", "~/nope/imdb", "a/b/c", "train.jsonl.gz"]:
        with pytest.raises(FileNotFoundError, match="missing|data/imdb|nope|a/b/c|train.jsonl.gz"):
            dataset_source(local_looking)


# ---------------------------------------------------------------------------------------------
# translation, local files
# ---------------------------------------------------------------------------------------------


def test_translation_local_default_splits(multi30k_like: Path) -> None:
    ds = load_translation_dataset(multi30k_like)
    assert isinstance(ds, datasets.DatasetDict)
    assert list(ds) == ["train", "validation", "test"]
    assert {name: len(split) for name, split in ds.items()} == {"train": 40, "validation": 7, "test": 5}
    for split in ds.values():
        assert split.column_names == ["translation"]
        assert isinstance(split.features["translation"], datasets.Translation)
    assert ds["train"][3]["translation"] == {"de": "train de Satz 3.", "en": "train en Satz 3."}
    assert ds["validation"][6]["translation"] == {"de": "val de Satz 6.", "en": "val en Satz 6."}
    assert ds["test"][0]["translation"] == {"de": "test_2016_flickr de Satz 0.", "en": "test_2016_flickr en Satz 0."}


def test_translation_reverse_direction_and_plain_files(tmp_path: Path) -> None:
    make_parallel(tmp_path, "train", 10, gz=False, langs=("en", "fr"))
    make_parallel(tmp_path, "dev", 4, gz=False, langs=("en", "fr"))
    ds = load_translation_dataset(tmp_path, source_lang="fr", target_lang="en")
    assert list(ds) == ["train", "validation"]
    assert ds["validation"][1]["translation"] == {"fr": "dev fr Satz 1.", "en": "dev en Satz 1."}


def test_translation_explicit_split_files(multi30k_like: Path) -> None:
    ds = load_translation_dataset(
        multi30k_like, split_files={"train": "train", "validation": "val", "test": "test_2017_mscoco"}
    )
    assert len(ds["test"]) == 3
    assert ds["test"][2]["translation"]["en"] == "test_2017_mscoco en Satz 2."
    # only the named splits are loaded; no validation is carved when one is given
    only_test = load_translation_dataset(multi30k_like, split_files={"test": "test_2016_flickr"})
    assert list(only_test) == ["test"]


def test_translation_line_handling(tmp_path: Path) -> None:
    # CRLF endings are stripped, and U+2028 / form feed inside a sentence must not split it
    (tmp_path / "train.de").write_bytes("Erste Zeile\u2028 mit Trenner\r\nZweite\x0cZeile \r\n".encode())
    (tmp_path / "train.en").write_bytes(b"First line\r\nSecond line")  # no final newline
    ds = load_translation_dataset(tmp_path, validation_size=None)
    assert list(ds) == ["train"]
    assert ds["train"]["translation"][:] == [
        {"de": "Erste Zeile\u2028 mit Trenner", "en": "First line"},
        {"de": "Zweite\x0cZeile", "en": "Second line"},
    ]


def test_translation_carves_deterministic_validation(tmp_path: Path) -> None:
    make_parallel(tmp_path, "train", 50)
    first = load_translation_dataset(tmp_path, validation_size=0.2, seed=3)
    again = load_translation_dataset(tmp_path, validation_size=0.2, seed=3)
    other = load_translation_dataset(tmp_path, validation_size=0.2, seed=4)
    assert (len(first["train"]), len(first["validation"])) == (40, 10)
    assert first["validation"]["translation"][:] == again["validation"]["translation"][:]
    assert first["validation"]["translation"][:] != other["validation"]["translation"][:]
    train = [p["en"] for p in first["train"]["translation"]]
    val = [p["en"] for p in first["validation"]["translation"]]
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(f"train en Satz {i}." for i in range(50))
    key = lambda s: int(s.rsplit(" ", 1)[1].rstrip("."))  # noqa: E731
    assert train == sorted(train, key=key) and val == sorted(val, key=key)  # file order kept
    by_count = load_translation_dataset(tmp_path, validation_size=5)
    assert len(by_count["validation"]) == 5 and len(by_count["train"]) == 45


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1, -3, 50, 80, "0.1", True])
def test_translation_bad_validation_size(tmp_path: Path, bad) -> None:
    make_parallel(tmp_path, "train", 50)
    with pytest.raises(ValueError, match="validation_size"):
        load_translation_dataset(tmp_path, validation_size=bad)


def test_translation_max_samples(multi30k_like: Path) -> None:
    ds = load_translation_dataset(multi30k_like, max_samples={"train": 10, "validation": None})
    assert (len(ds["train"]), len(ds["validation"]), len(ds["test"])) == (10, 7, 5)
    again = load_translation_dataset(multi30k_like, max_samples={"train": 10})
    assert ds["train"]["translation"][:] == again["train"]["translation"][:]
    numbers = [int(p["de"].split()[-1].rstrip(".")) for p in ds["train"]["translation"]]
    assert numbers == sorted(numbers) and numbers != list(range(10))  # random subset, file order
    all_capped = load_translation_dataset(multi30k_like, max_samples=6)
    assert {name: len(split) for name, split in all_capped.items()} == {"train": 6, "validation": 6, "test": 5}
    with pytest.raises(ValueError, match="dev"):
        load_translation_dataset(multi30k_like, max_samples={"dev": 3})
    with pytest.raises(ValueError, match="train"):
        load_translation_dataset(multi30k_like, max_samples={"train": 0})


def test_translation_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_translation_dataset(tmp_path / "does-not-exist")

    a_file = write_lines(tmp_path / "train.de", ["x"])
    with pytest.raises(ValueError, match="directory"):
        load_translation_dataset(a_file)

    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match=r"train\.de"):
        load_translation_dataset(empty_dir)

    missing_target = tmp_path / "missing_target"
    make_parallel(missing_target, "train", 3, langs=("de",))
    with pytest.raises(FileNotFoundError, match=r"train\.en"):
        load_translation_dataset(missing_target)

    mismatch = tmp_path / "mismatch"
    make_parallel(mismatch, "train", 5)
    write_lines(mismatch / "train.en.gz", ["one", "two", "three"])
    with pytest.raises(ValueError, match=r"train\.de\.gz has 5 lines but .*train\.en\.gz has 3"):
        load_translation_dataset(mismatch)

    empty_file = tmp_path / "empty_file"
    make_parallel(empty_file, "train", 5)
    write_lines(empty_file / "train.en.gz", [])
    with pytest.raises(ValueError, match=r"Empty file.*train\.en\.gz"):
        load_translation_dataset(empty_file)

    with pytest.raises(FileNotFoundError, match=r"'test'.*nope\.de"):
        load_translation_dataset(mismatch, split_files={"test": "nope"})

    both = tmp_path / "both"
    make_parallel(both, "train", 2, gz=True)
    make_parallel(both, "train", 2, gz=False)
    with pytest.raises(ValueError, match="Both"):
        load_translation_dataset(both)

    ambiguous = tmp_path / "ambiguous"
    make_parallel(ambiguous, "train", 2)
    make_parallel(ambiguous, "test", 2)
    make_parallel(ambiguous, "test_2016_flickr", 2)
    with pytest.raises(ValueError, match="ambiguous"):
        load_translation_dataset(ambiguous)

    with pytest.raises(ValueError, match="both 'de'"):
        load_translation_dataset(ambiguous, "de", "de")


# ---------------------------------------------------------------------------------------------
# translation, Hub (load_dataset mocked: no network here)
# ---------------------------------------------------------------------------------------------


def test_translation_hub_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        make = lambda n, tag: datasets.Dataset.from_dict(  # noqa: E731
            {"en": [f"{tag} en {i}" for i in range(n)], "de": [f"{tag} de {i}" for i in range(n)], "id": list(range(n))}
        )
        return datasets.DatasetDict({"train": make(12, "tr"), "validation": make(3, "va"), "test": make(2, "te")})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_translation_dataset("bentrevett/multi30k", revision="main")
    assert calls == [("bentrevett/multi30k", None, {"revision": "main"})]
    assert {name: len(split) for name, split in ds.items()} == {"train": 12, "validation": 3, "test": 2}
    assert ds["train"].column_names == ["translation"]
    assert ds["train"].features == datasets.Features({"translation": datasets.Translation(languages=["de", "en"])})
    assert ds["test"][1]["translation"] == {"de": "te de 1", "en": "te en 1"}
    assert isinstance(ds["train"].features["translation"], datasets.Translation)

    with pytest.raises(ValueError, match=r"\['fr'\]"):
        load_translation_dataset("bentrevett/multi30k", "fr", "en")
    with pytest.raises(ValueError, match="split_files"):
        load_translation_dataset("bentrevett/multi30k", split_files={"train": "train"})


def test_translation_hub_translation_column(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_load_dataset(path, name=None, **kwargs):
        assert (path, name) == ("wmt/wmt-like", "de-en")
        features = datasets.Features({"translation": datasets.Translation(languages=["de", "en", "fr"])})
        rows = [{"de": f"d{i}", "en": f"e{i}", "fr": f"f{i}"} for i in range(20)]
        train = datasets.Dataset.from_dict({"translation": rows}, features=features)
        unsup = datasets.Dataset.from_dict({"translation": rows[:2]}, features=features)
        return datasets.DatasetDict({"train": train, "dev": train.select(range(4)), "extra": unsup})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_translation_dataset("wmt/wmt-like", "en", "de", config_name="de-en")
    assert list(ds) == ["train", "validation"]  # "dev" renamed, unknown "extra" dropped
    assert ds["validation"][0]["translation"] == {"de": "d0", "en": "e0"}
    with pytest.raises(ValueError, match="missing.*'it'"):
        load_translation_dataset("wmt/wmt-like", "it", "de", config_name="de-en")


def test_hub_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_canonical(path, name=None, **kwargs):
        return datasets.DatasetDict({"unsupervised": datasets.Dataset.from_dict({"de": ["a"], "en": ["b"]})})

    monkeypatch.setattr(datasets, "load_dataset", no_canonical)
    with pytest.raises(ValueError, match="unsupervised"):
        load_translation_dataset("org/odd")

    def offline(path, name=None, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConnectionError, match=r"'stanfordnlp/imdb' is not an existing local path.* could not be "
                       r"loaded \(Couldn't reach the Hub\)\. Without network, pass a local copy of the data with "
                       r"--data_dir DIR"):
        load_classification_dataset("stanfordnlp/imdb")

    def missing(path, name=None, **kwargs):
        raise FileNotFoundError("no such dataset")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(FileNotFoundError) as info:
        load_classification_dataset("stanfordnlp/imdb")
    if sys.version_info >= (3, 11):  # exception notes
        assert any("not an existing local path" in note for note in info.value.__notes__)


# ---------------------------------------------------------------------------------------------
# classification, local files
# ---------------------------------------------------------------------------------------------


def test_classification_jsonl_stratified_split(tmp_path: Path) -> None:
    rows = imdb_rows(30) + [{"text": f"extra positive {i}", "label": 1, "id": f"pos_x{i}"} for i in range(10)]
    write_jsonl(tmp_path / "train.jsonl.gz", rows)  # 40 positive, 30 negative
    ds = load_classification_dataset(tmp_path, validation_size=0.2, extra_columns=("id",))
    assert list(ds) == ["train", "validation"]
    assert ds["train"].column_names == ["text", "label", "id"]
    assert ds["train"].features["label"] == datasets.Value("int64")
    assert ds["train"].features["text"] == datasets.Value("string")
    assert (len(ds["train"]), len(ds["validation"])) == (56, 14)
    assert collections.Counter(column(ds["validation"], "label")) == {1: 8, 0: 6}  # 40:30 kept
    again = load_classification_dataset(tmp_path, validation_size=0.2, extra_columns=("id",))
    assert list(ds["validation"]["text"]) == list(again["validation"]["text"])
    plain = load_classification_dataset(tmp_path, validation_size=0.2)
    assert plain["train"].column_names == ["text", "label"]
    unstratified = [
        collections.Counter(
            load_classification_dataset(tmp_path, validation_size=14, stratify=False, seed=s)["validation"]["label"]
        )
        for s in range(6)
    ]
    assert any(c != {1: 8, 0: 6} for c in unstratified)  # not stratified -> shares vary with the random seed


def test_classification_csv_and_column_names(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "train.csv.gz", "wt", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["review", "stars", "other"])
        writer.writerow(['A "quoted", multi-line\nreview', "4", "x"])
        for i in range(9):
            writer.writerow([f"review {i}", str(i % 5), "y"])
    with open(tmp_path / "dev.csv", "w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["stars", "review"])
        writer.writerow(["2", "dev review"])
    ds = load_classification_dataset(tmp_path, text_column="review", label_column="stars")
    assert list(ds) == ["train", "validation"]
    assert ds["train"][0] == {"text": 'A "quoted", multi-line\nreview', "label": 4}
    assert ds["validation"][0] == {"text": "dev review", "label": 2}
    assert ds["train"].features == ds["validation"].features


def test_classification_single_file_and_split_files(tmp_path: Path) -> None:
    file = write_jsonl(tmp_path / "reviews.jsonl", imdb_rows(10))
    ds = load_classification_dataset(file, validation_size=4)
    assert (len(ds["train"]), len(ds["validation"])) == (16, 4)
    assert collections.Counter(column(ds["validation"], "label")) == {0: 2, 1: 2}
    write_jsonl(tmp_path / "held_out.jsonl", imdb_rows(2))
    mapped = load_classification_dataset(tmp_path, split_files={"train": "reviews.jsonl", "test": "held_out.jsonl"})
    assert list(mapped) == ["train", "validation", "test"] and len(mapped["test"]) == 4
    mapped_abs = load_classification_dataset(tmp_path, split_files={"train": str(file)}, validation_size=None)
    assert len(mapped_abs["train"]) == 20


def test_classification_extra_column_mixed_types(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": 0, "id": 7}, {"text": "b", "label": 1, "id": "x"}])
    with pytest.raises(ValueError, match="extra column 'id' has values of mixed types"):
        load_classification_dataset(tmp_path, extra_columns=("id",))
    with pytest.raises(ValueError, match=r"missing column\(s\) \['rating'\]"):
        load_classification_dataset(tmp_path, extra_columns=("rating",))


def test_classification_labels(tmp_path: Path) -> None:
    rows = [{"text": "a", "label": 1.0}, {"text": "b", "label": " 2 "}, {"text": "c", "label": -1}]
    write_jsonl(tmp_path / "train.jsonl", rows)
    ds = load_classification_dataset(tmp_path, validation_size=None)
    assert list(column(ds["train"], "label")) == [1, 2, -1]


def test_classification_label_range(tmp_path: Path) -> None:
    """Declared classes (num_labels) or class ids (no negatives): an out-of-range label is a
    ValueError naming file, line and value (a 7 in binary data built an 8-class model; -1 crashed
    mid-training; 1e30 raised a raw OverflowError)."""
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": 1}, {"text": "c", "label": 7}])
    with pytest.raises(ValueError, match=r"train\.jsonl line 3: label column 'label' has the value 7; class ids must be 0\.\.1 \(2 classes\)"):
        load_classification_dataset(tmp_path, num_labels=2)
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a", "label": 0}, {"text": "b", "label": -1}])
    with pytest.raises(ValueError, match=r"train\.jsonl line 2: .*value -1; class ids must be at least 0"):
        load_classification_dataset(tmp_path, allow_negative_labels=False)
    (tmp_path / "train.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1e30}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl line 2: .*1e\+30, too large for a class id"):
        load_classification_dataset(tmp_path)
    (tmp_path / "train.jsonl").unlink()
    (tmp_path / "train.csv").write_text("text,label\na,0\nb,99999999999999999999999\n")
    with pytest.raises(ValueError, match=r"train\.csv line 3: .*too large for a class id"):
        load_classification_dataset(tmp_path)


def test_unreadable_files_name_file_and_line(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 and truncated .gz files: ValueError naming file and line (was a raw
    UnicodeDecodeError / EOFError without the file), for both loaders."""
    clf = tmp_path / "clf"
    clf.mkdir()
    (clf / "train.jsonl").write_bytes(b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    with pytest.raises(ValueError, match=r"train\.jsonl line 2: not valid UTF-8 \(byte b'\\xe9' at column 14\)"):
        load_classification_dataset(clf)
    (clf / "train.jsonl").unlink()
    payload = gzip.compress("".join(json.dumps({"text": f"row {i}", "label": i % 2}) + "\n" for i in range(2000)).encode())
    (clf / "train.jsonl.gz").write_bytes(payload[: len(payload) // 2])
    with pytest.raises(ValueError, match=r"train\.jsonl\.gz: truncated or corrupt gzip file .*breaks off in line \d+"):
        load_classification_dataset(clf)

    mt = tmp_path / "mt"
    make_parallel(mt, "train", 3, gz=False)
    (mt / "train.en").write_bytes(b"one\ntwo \xff\nthree\n")
    with pytest.raises(ValueError, match=r"train\.en line 2: not valid UTF-8"):
        load_translation_dataset(mt)
    make_parallel(mt, "train", 2000, gz=True)
    for name in ("train.de", "train.en"):
        (mt / name).unlink()
    data = (mt / "train.de.gz").read_bytes()
    (mt / "train.de.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"train\.de\.gz: truncated or corrupt gzip file"):
        load_translation_dataset(mt)
    (mt / "train.de.gz").write_bytes(gzip.compress("ein satz\n".encode() * 5))  # 5 lines against 2000
    with pytest.raises(ValueError, match=r"train\.de\.gz has 5 lines but .*train\.en\.gz has 2000"):
        load_translation_dataset(mt)


def test_unreadable_files_are_named_whatever_reads_them_first(tmp_path: Path) -> None:
    """The scripts' grouped loading reads the first record for its group column before the rows:
    a .gz file that is not gzip and bytes that are not UTF-8 were a raw BadGzipFile /
    UnicodeDecodeError there, without the file."""
    clf = tmp_path / "clf"
    clf.mkdir()
    (clf / "train.jsonl.gz").write_text('{"text": "plain text", "label": 0}\n')  # named .gz, never compressed
    for group in (None, "movie"):
        with pytest.raises(ValueError, match=r"train\.jsonl\.gz: not a gzip file \(it starts with b'\{\"text"):
            load_classification_dataset(clf, group_column=group)
    (clf / "train.jsonl.gz").unlink()
    (clf / "train.jsonl").write_bytes(b'{"text": "ok", "label": 0, "movie": 1}\n{"text": "caf\xe9", "label": 1}\n')
    for group in (None, "movie"):
        with pytest.raises(ValueError, match=r"train\.jsonl line 2: not valid UTF-8 \(byte b'\\xe9' at column 14\)"):
            load_classification_dataset(clf, group_column=group)
    from hf_zformer.data import load_text_dataset

    with pytest.raises(ValueError, match=r"train\.jsonl line 2: not valid UTF-8"):
        load_text_dataset(clf / "train.jsonl", group_column="movie")


@pytest.mark.parametrize("bad_label", ["pos", 0.5, True, None, [1]])
def test_classification_non_integer_label(tmp_path: Path, bad_label) -> None:
    write_jsonl(tmp_path / "train.jsonl", [{"text": "fine", "label": 0}, {"text": "bad", "label": bad_label}])
    with pytest.raises(ValueError, match=r"train\.jsonl line 2.*'label'.*non-integer value"):
        load_classification_dataset(tmp_path)


def test_classification_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-imdb-here"):
        load_classification_dataset(tmp_path / "no-imdb-here")

    missing_col = tmp_path / "missing_col"
    missing_col.mkdir()
    write_jsonl(missing_col / "train.jsonl", [{"text": "x", "label": 0}, {"review": "y", "label": 1}])
    with pytest.raises(ValueError, match=r"line 2: missing column\(s\) \['text'\]"):
        load_classification_dataset(missing_col)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['sentiment'\]"):
        load_classification_dataset(missing_col, label_column="sentiment")

    csv_dir = tmp_path / "csv"
    csv_dir.mkdir()
    (csv_dir / "train.csv").write_text("sentence,label\nhello,1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['text'\]; the header has \['sentence', 'label'\]"):
        load_classification_dataset(csv_dir)
    (csv_dir / "train.csv").write_text("text,label\nhello,positive\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'positive'"):
        load_classification_dataset(csv_dir)

    for name, content in [("train.csv", ""), ("train.jsonl", "\n\n")]:
        empty = tmp_path / f"empty_{name}"
        empty.mkdir()
        (empty / name).write_text(content, encoding="utf-8")
        with pytest.raises(ValueError, match=f"Empty file.*{name}"):
            load_classification_dataset(empty)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"text": "a", "label": 0}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: invalid JSON"):
        load_classification_dataset(broken)
    (broken / "train.jsonl").write_text("[1, 2]\n", encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_classification_dataset(broken)
    (broken / "train.jsonl").write_text('{"text": 5, "label": 0}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="non-string value 5"):
        load_classification_dataset(broken)

    no_train = tmp_path / "no_train"
    no_train.mkdir()
    write_jsonl(no_train / "test.jsonl", [{"text": "x", "label": 0}])
    with pytest.raises(FileNotFoundError, match="No training file"):
        load_classification_dataset(no_train)
    with pytest.raises(FileNotFoundError, match="'train'.*missing.jsonl"):
        load_classification_dataset(no_train, split_files={"train": "missing.jsonl"})
    (no_train / "notes.txt").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="Unsupported file type.*notes.txt"):
        load_classification_dataset(no_train, split_files={"train": "notes.txt"})
    with pytest.raises(ValueError, match="extra_columns"):
        load_classification_dataset(no_train, extra_columns=("label",))

    two = tmp_path / "two"
    two.mkdir()
    write_jsonl(two / "train.jsonl", [{"text": "x", "label": 0}])
    (two / "train.csv").write_text("text,label\nx,0\n", encoding="utf-8")
    with pytest.raises(ValueError, match="ambiguous"):
        load_classification_dataset(two)


# ---------------------------------------------------------------------------------------------
# classification, Hub (mocked)
# ---------------------------------------------------------------------------------------------


def fake_imdb(path, name=None, **kwargs):
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    unsup_features = datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    train = datasets.Dataset.from_dict(
        {"text": [f"review {i}" for i in range(40)], "label": [i % 2 for i in range(40)]}, features=features
    )
    test = datasets.Dataset.from_dict({"text": ["t0", "t1"], "label": [1, 0]}, features=features)
    unsup = datasets.Dataset.from_dict({"text": ["u"], "label": [-1]}, features=unsup_features)
    return datasets.DatasetDict({"train": train, "test": test, "unsupervised": unsup})


def test_classification_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "load_dataset", fake_imdb)
    ds = load_classification_dataset("stanfordnlp/imdb", validation_size=0.25)
    assert list(ds) == ["train", "validation", "test"]
    assert {name: len(split) for name, split in ds.items()} == {"train": 30, "validation": 10, "test": 2}
    assert ds["train"].features == datasets.Features(  # the class names survive (the scripts' id2label)
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
    )
    assert collections.Counter(column(ds["validation"], "label")) == {0: 5, 1: 5}
    assert ds["test"][0] == {"text": "t0", "label": 1}
    with pytest.raises(ValueError, match=r"split 'train' has no column\(s\) \['sentence'\]"):
        load_classification_dataset("stanfordnlp/imdb", text_column="sentence")


def test_classification_hub_string_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(path, name=None, **kwargs):
        train = datasets.Dataset.from_dict({"sentence": ["a", "b"], "sentiment": ["pos", "neg"]})
        return datasets.DatasetDict({"train": train})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    with pytest.raises(ValueError, match=r"split 'train'.*'sentiment'.*non-integer value '(pos|neg)'"):
        load_classification_dataset("org/sst-like", text_column="sentence", label_column="sentiment")


# ---------------------------------------------------------------------------------------------
# real data in ../shared/data
# ---------------------------------------------------------------------------------------------


@needs_shared_data
def test_multi30k_shared() -> None:
    ds = load_translation_dataset(SHARED_DATA / "multi30k")
    assert list(ds) == ["train", "validation", "test"]
    assert {name: len(split) for name, split in ds.items()} == {"train": 29000, "validation": 1014, "test": 1000}
    first = ds["train"][0]["translation"]
    assert first["de"] == "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."
    assert first["en"] == "Two young, White males are outside near many bushes."
    assert all(pair["de"] and pair["en"] for pair in ds["test"]["translation"])


@needs_shared_data
def test_imdb_shared_deterministic_validation() -> None:
    ds = load_classification_dataset(SHARED_DATA / "imdb", extra_columns=("id",))
    again = load_classification_dataset(SHARED_DATA / "imdb", extra_columns=("id",))
    assert list(ds) == ["train", "validation", "test"]  # the official test split, kept apart from the carve
    assert (len(ds["train"]), len(ds["validation"]), len(ds["test"])) == (22500, 2500, 25000)
    assert collections.Counter(column(ds["test"], "label")) == {0: 12500, 1: 12500}
    assert collections.Counter(column(ds["validation"], "label")) == {0: 1250, 1: 1250}
    assert collections.Counter(column(ds["train"], "label")) == {0: 11250, 1: 11250}
    train_ids, val_ids = set(column(ds["train"], "id")), set(column(ds["validation"], "id"))
    assert not train_ids & val_ids
    assert len(train_ids | val_ids) == 25000
    assert list(column(again["validation"], "id")) == list(column(ds["validation"], "id"))
    assert list(column(again["train"], "id")) == list(column(ds["train"], "id"))
    assert isinstance(ds["train"][0]["text"], str) and ds["train"][0]["label"] in (0, 1)

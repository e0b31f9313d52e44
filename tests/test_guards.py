"""What the scripts and the converter refuse, and what they never do: delete a folder that is not a
model, save a tokenizer that turns every word into [UNK], resume another run, save a diverged
model, evaluate at another length than the training one, or fail with a raw traceback.

Refusals come before any work, exit with code 2 and name the bad value."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_scripts
from test_convert import _bert_tokenizer, make_source
from test_scripts import TINY_CLF, TINY_MT, load_script, run_script, run_script_failing, tiny_data  # noqa: F401  (fixture)

import hf_zformer
from hf_zformer.folders import check_output_dir, record, replace_atomically, staging_dir

CLF = ["--attention_type", "zformer", "--config_overrides", TINY_CLF, "--vocab_size", 120, "--max_length", 32,
       "--per_device_train_batch_size", 16]


def refused(name, *args, message, code=2, env=None):
    """Run scripts/<name>, expect exit code ``code`` and ``message`` in its stderr; the output."""
    result = run_script_failing(name, *args, env=env)
    assert result.returncode == code, result.stderr[-3000:]
    assert message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


# ---- the folder guard ----------------------------------------------------------------------

def test_folder_guard_never_replaces_the_current_home_root_or_foreign_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    for folder, why in (("", "is empty"), (".", "current directory"), ("..", "contains the current directory"),
                        ("/", "root directory"), (str(Path.home()), "home directory"), ("~", "home directory")):
        with pytest.raises(ValueError, match=why):
            check_output_dir(folder, overwrite=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "table.csv").write_text("a,b")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="did not write"):
            check_output_dir("data", overwrite=overwrite)
    with pytest.raises(ValueError, match="is a file"):
        check_output_dir("notes.txt", overwrite=True)
    with pytest.raises(ValueError, match="which is a file"):
        check_output_dir("notes.txt/model", overwrite=True)
    staged = staging_dir(tmp_path, "data")
    with pytest.raises(ValueError, match="did not write"):
        replace_atomically(staged, tmp_path / "data")
    assert (tmp_path / "data" / "table.csv").read_text() == "a,b" and (tmp_path / "notes.txt").exists()
    # a config.json proves nothing: only the library's marker makes a folder replaceable
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="did not write"):
        check_output_dir("model", overwrite=True)
    replace_atomically(staging_dir(tmp_path, "ours"), tmp_path / "ours")
    (tmp_path / "ours" / "config.json").write_text("{}")
    record(tmp_path / "ours", "config.json")
    with pytest.raises(ValueError, match="exists and is not empty"):
        check_output_dir("ours")
    assert check_output_dir("ours", overwrite=True) == Path("ours")  # the library's own folder may be replaced
    check_output_dir(tmp_path / "new-folder")  # nothing there yet: fine


@pytest.mark.parametrize("output_dir", ["", "."])
def test_converter_never_deletes_the_current_directory(tmp_path, output_dir):
    """What an unset "$OUT" gives, run from a folder holding the user's files."""
    source, _ = make_source(tmp_path, "bert", "classification")
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("user data")
    result = run_in(work, "convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer",
                    "--output_dir", output_dir, "--overwrite")
    assert result.returncode == 2 and "--output_dir" in result.stderr, result.stderr[-3000:]
    assert (work / "keep.txt").read_text() == "user data" and sorted(p.name for p in work.iterdir()) == ["keep.txt"]


def test_converter_checks_its_output_folder_before_any_work(tmp_path):
    """A non-empty folder without --overwrite, a file, a path under a file: refused at once (the
    source path is checked later, so a bad source in the same command shows the order)."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    for output_dir, message in ((busy, "did not write (x.txt"), (tmp_path / "file", "is a file"),
                                (tmp_path / "file" / "sub", "which is a file")):
        refused("convert_checkpoint.py", "--model_name_or_path", tmp_path / "missing-source", "--attention_type",
                "zformer", "--output_dir", output_dir, "--overwrite" if output_dir != busy else "--seed=0",
                message=message)
    assert (busy / "x.txt").exists()


# ---- nothing a user made is deleted, renamed or overwritten (real script runs, canary files) ----

def plant(root, files):
    """Write the user's ``files`` ({relative path: text}) under ``root``; returns them."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return files


def assert_kept(root, files):
    """Each planted file is still there, a plain file, with its text (nothing deleted, renamed or overwritten)."""
    for name, text in files.items():
        path = root / name
        assert path.is_file() and not path.is_symlink() and path.read_text() == text, name


def tree(root):
    """Every file under ``root`` with its bytes (links by their target), links not followed."""
    found = {}
    for current, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if (Path(current) / d).is_symlink()]:
            path = Path(current) / name
            found[path.relative_to(root).as_posix()] = os.readlink(path) if path.is_symlink() else path.read_bytes()
    return found


def offline_env() -> dict:
    """This process's environment with the Hub and datasets offline: the scripts' runs here."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_in(cwd, name, *args, env=None):
    """scripts/<name> run from ``cwd`` (the scripts' own helper runs from the repository root), in a
    process of its own (tests/warm_scripts.py); stdout and stderr as text."""
    script = Path(__file__).resolve().parents[1] / "scripts" / name
    return warm_scripts.run_python([sys.executable, script, *args], cwd=cwd, env={**offline_env(), **(env or {})})


USER_FOLDERS = {".tmp-cache/a.bin": "cache", ".old-notes/n.txt": "old notes", "notes/n.txt": "notes",
                ".old-photos/p.jpg": "photo"}


def kill_between_renames(monkeypatch, staging, final):
    """Run ``replace_atomically(staging, final)`` and stop it as a kill would, after the old folder
    was renamed away and before the new one is in place."""
    from hf_zformer import folders

    real = os.replace

    def dying(src, dst):
        if Path(src) == Path(staging):
            raise KeyboardInterrupt("killed")
        return real(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(folders.os, "replace", dying)
        with pytest.raises(KeyboardInterrupt):
            replace_atomically(staging, final)


def test_training_start_touches_no_folder_of_the_user(tmp_path, tiny_data, monkeypatch):  # noqa: F811
    """A folder of the user's is refused as it is; in the library's own run folder the user's
    .tmp-*/.old-* folders are kept at the start, and a checkpoint whose replacement was killed
    between the two renames is restored from the marked backup, not deleted."""
    foreign = tmp_path / "foreign"
    planted = plant(foreign, USER_FOLDERS)
    refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--output_dir", foreign,
            message="holds files this library did not write")
    assert tree(foreign) == {name: text.encode() for name, text in planted.items()}
    out = tmp_path / "run"
    data = ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 2, "--checkpointing_steps", 1,
            "--output_dir", out]
    run_script("run_classification.py", *data)
    before = (out / "step_2" / "training_state.json").read_text()
    planted = plant(out, USER_FOLDERS)
    staging = staging_dir(out, "step_2")
    kill_between_renames(monkeypatch, staging, out / "step_2")
    assert not (out / "step_2").exists() and len(list(out.glob(".hf_zformer-backup-step_2-*"))) == 1
    result = run_script("run_classification.py", *data, "--resume_from_checkpoint", "latest")
    assert "restored as" in result.stderr
    assert (out / "step_2" / "training_state.json").read_text() == before
    assert_kept(out, planted)
    assert not list(out.glob(".hf_zformer-*-*")) and not (out / "photos").exists()


def test_training_refuses_the_current_home_and_foreign_folders(tmp_path, tiny_data):  # noqa: F811
    work, home = tmp_path / "work", tmp_path / "home"
    planted = plant(work, {"thesis.tex": "chapter 1", "data/table.csv": "a,b"})
    plant(home, {".bashrc": "alias ll=ls"})
    common = ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1]
    for output_dir, message in ((".", "it is the current directory"), ("~", "it is the home directory"),
                                (home, "it is the home directory"), ("data", "did not write (table.csv")):
        result = run_in(work, "run_classification.py", *common, "--output_dir", output_dir, env={"HOME": str(home)})
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, \
            result.stderr[-3000:]
    assert tree(work) == {name: text.encode() for name, text in planted.items()}
    assert tree(home) == {".bashrc": b"alias ll=ls"}


def test_overwrite_output_dir_deletes_only_what_a_run_recorded(tmp_path, tiny_data):  # noqa: F811
    out = tmp_path / "run"
    data = ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 2, "--checkpointing_steps", 1,
            "--eval_steps", 1, "--save_best", "--output_dir", out]
    run_script("run_classification.py", *data)
    plant(out, {"best/photo.jpg": "the user's photo"})
    before = tree(out)
    result = refused("run_classification.py", *data, "--overwrite_output_dir", message="best/photo.jpg")
    assert "did not write" in result.stderr and tree(out) == before  # refused before deleting anything
    (out / "best" / "photo.jpg").unlink()
    planted = plant(out, {"photo.jpg": "the user's photo", "mine/training_state.json": "{}", "mine/notes.txt": "x"})
    run_script("run_classification.py", *data, "--overwrite_output_dir", "--max_train_steps", 1)
    assert_kept(out, planted)
    assert not (out / "step_2").exists() and (out / "step_1").is_dir() and (out / "best" / "best_state.json").is_file()
    history = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1]


def test_converter_overwrite_replaces_only_a_folder_it_wrote(tmp_path):
    source, _ = make_source(tmp_path, "bert", "classification")
    convert = ["--model_name_or_path", source, "--attention_type", "zformer", "--overwrite"]
    not_ours = tmp_path / "W"
    planted = plant(not_ours, {"config.json": "{}", "notes.txt": "mine"})
    refused("convert_checkpoint.py", *convert, "--output_dir", not_ours, message="did not write (config.json, notes.txt")
    assert tree(not_ours) == {name: text.encode() for name, text in planted.items()}
    # a folder the converter wrote, next to the user's .old-<name> and .tmp-<name> folders
    out = tmp_path / "out"
    run_script("convert_checkpoint.py", *convert[:-1], "--output_dir", out)
    siblings = plant(tmp_path, {".old-out/keep.txt": "old", ".tmp-out/keep.txt": "tmp", "out.bak/keep.txt": "bak"})
    (out / "notes.txt").write_text("added by the user")
    refused("convert_checkpoint.py", *convert, "--output_dir", out, message="did not write (notes.txt")
    (out / "notes.txt").unlink()
    run_script("convert_checkpoint.py", *convert[:2], "--attention_type", "fastformer", "--overwrite", "--output_dir", out)
    assert json.loads((out / "config.json").read_text())["attention_type"] == "fastformer"
    assert_kept(tmp_path, siblings)
    umask = os.umask(0o022)
    os.umask(umask)
    assert not list(tmp_path.glob(".hf_zformer-*")) and out.stat().st_mode & 0o777 == 0o777 & ~umask


def test_converter_never_writes_over_its_source(tmp_path):
    source, _ = make_source(tmp_path, "bert", "classification")
    before = tree(source)
    for output_dir, message in ((source, "is --model_name_or_path"), (tmp_path, "contains --model_name_or_path")):
        refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer", "--overwrite",
                "--output_dir", output_dir, message=message)
    assert tree(source) == before
    # a folder the converter wrote, converted again into itself
    run_script("convert_checkpoint.py", "--model_name_or_path", source, "--output_dir", tmp_path / "full")
    converted = tree(tmp_path / "full")
    refused("convert_checkpoint.py", "--model_name_or_path", tmp_path / "full", "--attention_type", "fastformer",
            "--overwrite", "--output_dir", tmp_path / "full", message="is --model_name_or_path")
    assert tree(tmp_path / "full") == converted


def test_training_and_evaluation_never_write_over_their_model_or_teacher(tmp_path, tiny_data,  # noqa: F811
                                                                       trained_classifier):
    model = tmp_path / "model"
    import shutil

    shutil.copytree(trained_classifier, model)
    before = tree(model)
    common = ["--data_dir", tiny_data / "clf", "--max_train_steps", 1, "--overwrite_output_dir"]
    refused("run_classification.py", "--model_name_or_path", model, *common, "--output_dir", model,
            message="is --model_name_or_path")
    refused("run_classification.py", "--model_name_or_path", trained_classifier, *common, "--teacher_model_name_or_path",
            model, "--output_dir", model, message="is --teacher_model_name_or_path")
    refused("evaluate_model.py", "--model_name_or_path", model, "--data_dir", tiny_data / "clf", "--output_dir", model,
            message="is --model_name_or_path")
    assert tree(model) == before


def test_converter_killed_between_renames_keeps_the_previous_model(tmp_path, monkeypatch):
    source, _ = make_source(tmp_path, "bert", "classification")
    out = tmp_path / "out"
    hf_zformer.convert_pretrained(source, "zformer", out)
    before = tree(out)
    kill_between_renames(monkeypatch, staging_dir(tmp_path, "out"), out)
    assert not out.exists()
    # the next run restores it first: without --overwrite it is refused as an existing folder, intact
    refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "fastformer",
            "--output_dir", out, message="exists and is not empty")
    assert tree(out) == before and not list(tmp_path.glob(".hf_zformer-*"))
    run_script("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "fastformer",
               "--output_dir", out, "--overwrite")
    assert json.loads((out / "config.json").read_text())["attention_type"] == "fastformer"


def test_converter_refuses_a_symlinked_output_folder(tmp_path):
    source, _ = make_source(tmp_path, "bert", "classification")
    hf_zformer.convert_pretrained(source, "zformer", tmp_path / "model")
    (tmp_path / "link").symlink_to(tmp_path / "model")
    before = tree(tmp_path)
    refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "fastformer", "--overwrite",
            "--output_dir", tmp_path / "link", message="is a symbolic link")
    assert tree(tmp_path) == before and os.readlink(tmp_path / "link") == str(tmp_path / "model")


# ---- refused: what makes a model silently wrong ----------------------------------------------

def test_non_finite_values_never_reach_a_saved_model(tmp_path, caplog):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="initializer_range=inf must be a finite number"):
        hf_zformer.ZformerConfig(attention_type="zformer", initializer_range=float("inf"))
    folder = tmp_path / "nan-config"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "zformer", "attention_type": "full", "layer_norm_eps": NaN}')
    with pytest.raises(ValueError, match="layer_norm_eps=nan must be a finite number"):
        AutoConfig.from_pretrained(folder)
    source, _ = make_source(tmp_path, "bert", "base")
    refused("convert_checkpoint.py", "--model_name_or_path", source, "--task", "text-classification",
            "--config_overrides", "initializer_range=inf", "--output_dir", tmp_path / "out",
            message="initializer_range=inf must be a finite number")
    from safetensors.torch import load_file, save_file

    weights = load_file(source / "model.safetensors")
    name = next(key for key in weights if key.endswith("query.weight"))
    weights[name][0, 0] = float("inf")
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds NaN or infinite values"):
        hf_zformer.convert_pretrained(source, "full", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".hf_zformer-*"))


@pytest.mark.parametrize("override", ["scale_embedding=yes", "hidden_act=relu", "layer_norm_eps=1e-5",
                                      "layer_norm_position=pre", "position_embedding_type=sinusoidal"])
def test_converter_refuses_overrides_that_change_what_the_weights_compute(tmp_path, override):
    from hf_zformer.training.arguments import parse_config_overrides

    source, _ = make_source(tmp_path, "bert", "classification")
    with pytest.raises(ValueError, match=f"{override.split('=')[0]}=.* cannot be set when converting: it changes "
                                         "what the pretrained weights compute"):
        hf_zformer.convert_pretrained(source, "full", **parse_config_overrides(override))
    hf_zformer.convert_pretrained(source, "full", **parse_config_overrides("hidden_act=gelu"))  # the source's own value


def test_converter_names_the_heads_it_starts_fresh(tmp_path, caplog):
    classifier, _ = make_source(tmp_path, "bert", "classification")
    masked_lm, _ = make_source(tmp_path, "bert", "masked-lm")
    for source, kwargs, part in ((classifier, dict(task="fill-mask"), "random lm_head"),
                                 (masked_lm, dict(task="text-classification", classifier_pooling="pooler"),
                                  "random pooler, classifier")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="hf_zformer.conversion.convert"):
            hf_zformer.convert_pretrained(source, "full", **kwargs)
        assert part in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_zformer.conversion.convert"):
        hf_zformer.convert_pretrained(classifier, "full")  # every head carries over: nothing to say
    assert "random" not in caplog.text


def test_training_refuses_meaningless_optimiser_values_and_distillation_without_teacher(tmp_path, tiny_data,  # noqa: F811
                                                                                        capsys):
    clf = load_script("run_classification.py")
    base = ["--data_dir", str(tiny_data / "clf"), "--attention_type", "zformer", "--output_dir", str(tmp_path / "o")]
    for extra, message in ((["--weight_decay", "-1"], "--weight_decay must be >= 0, got -1.0"),
                           (["--max_grad_norm", "-1"], "--max_grad_norm must be >= 0, got -1.0"),
                           (["--distill_alpha", "0.9"], "--distill_alpha 0.9 weighs a teacher's predictions, but no "
                                                        "--teacher_model_name_or_path"),
                           (["--distill_temperature", "4"], "--distill_temperature 4.0 weighs")):
        with pytest.raises(SystemExit) as stop:
            clf.parse_args([*base, *extra])
        assert stop.value.code == 2 and message in capsys.readouterr().err
    args = clf.parse_args(base)
    recorded = args.identity()
    assert (recorded["distill_alpha"], recorded["distill_temperature"]) == (0.5, 2.0)  # in the run's arguments as before


def test_a_config_with_an_option_of_an_earlier_version_is_refused_by_name(tmp_path):
    from transformers import AutoConfig

    config = hf_zformer.ZformerConfig(attention_type="fastformer", vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "fastformer_global_value": True}))
    with pytest.raises(ValueError, match="fastformer_global_value=True: this option .* was measured and removed"):
        AutoConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "fastformer_global_value": False}))
    assert AutoConfig.from_pretrained(tmp_path).attention_type == "fastformer"  # off: the same function


# ---- an `error:` line naming the input, exit code 2, before the work ----------------------------

def test_bad_results_file_seed_and_vocabulary_are_refused_at_the_start(tmp_path, tiny_data, capsys):  # noqa: F811
    """Found only after the whole run (or as a traceback) before: checked while parsing."""
    clf, evaluate = load_script("run_classification.py"), load_script("evaluate_model.py")
    (tmp_path / "object.json").write_text('{"value": 1}')
    (tmp_path / "results-dir").mkdir()
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    base = ["--data_dir", str(tiny_data / "clf"), "--attention_type", "zformer", "--output_dir", str(tmp_path / "o")]
    evaluation = ["--model_name_or_path", str(tmp_path / "m"), "--data_dir", str(tiny_data / "clf"),
                  "--output_dir", str(tmp_path / "e")]
    bad_files = ((tmp_path / "object.json", "must hold a JSON list of objects"),
                 (tmp_path / "results-dir", "is a directory"),
                 (tmp_path / "object.json" / "r.json", "is a file, not a folder"),
                 (tmp_path / "binary.json", "is not UTF-8 text"))
    cases = [(clf, [*base, "--results_file", str(path)], f"--results_file: results file {path}") for path, _ in bad_files]
    cases += [(evaluate, [*evaluation, "--results_file", str(path)], message) for path, message in bad_files]
    cases += [(clf, [*base, "--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
              (clf, [*base, "--split_seed", str(2**32)], "--split_seed must be in 0..4294967295"),
              (clf, [*base, "--vocab_size", "3"], "--vocab_size must be > 5 (the special tokens)")]
    for script, argv, message in cases:
        with pytest.raises(SystemExit) as stop:
            script.parse_args(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err, (argv, err)
    assert (tmp_path / "object.json").read_text() == '{"value": 1}'


def test_model_folders_that_do_not_load_are_named_with_exit_code_2(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    import shutil

    old = tmp_path / "old-version"
    shutil.copytree(trained_classifier, old)
    config = json.loads((old / "config.json").read_text())
    (old / "config.json").write_text(json.dumps({**config, "attention_type": "fastformer",
                                                 "fastformer_global_value": True}))
    refused("run_classification.py", "--model_name_or_path", old, "--data_dir", tiny_data / "clf", "--output_dir",
            tmp_path / "run", message="--model_name_or_path '" + str(old) + "': its config.json does not load: "
            "fastformer_global_value=True")
    evaluation = ["--data_dir", tiny_data / "clf", "--output_dir", tmp_path / "eval"]
    refused("evaluate_model.py", "--model_name_or_path", old, *evaluation, message="fastformer_global_value=True")
    notes = tmp_path / "notes"
    plant(notes, {"a.txt": "not a model"})
    refused("evaluate_model.py", "--model_name_or_path", notes, *evaluation, message="is not a saved model")
    refused("evaluate_model.py", "--model_name_or_path", trained_classifier, *evaluation, "--split", "bogus",
            message="--split 'bogus' is not a split of")
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(trained_classifier / name, bare / name)
    result = refused("evaluate_model.py", "--model_name_or_path", bare, *evaluation, message="has no tokenizer files")
    assert "sentencepiece" not in result.stderr


def test_unreadable_data_and_an_unreachable_hub_dataset_are_named_with_exit_code_2(tmp_path):
    """A train.jsonl.gz that is not gzip and bytes that are not UTF-8 (read first for the default
    --group_column) were tracebacks; a --dataset_name without network a ConnectionError traceback,
    exit code 1. Each is one error line naming the input, exit code 2, and no lock file stays."""
    run = ["--attention_type", "zformer", "--config_overrides", TINY_CLF, "--vocab_size", 120]
    not_gzip = tmp_path / "not-gzip"
    plant(not_gzip, {"train.jsonl.gz": '{"text": "plain text", "label": 0}\n'})
    refused("run_classification.py", "--data_dir", not_gzip, *run, "--output_dir", tmp_path / "o1",
            message=f"error: {not_gzip / 'train.jsonl.gz'}: not a gzip file")
    latin = tmp_path / "latin-1"
    latin.mkdir()
    (latin / "train.jsonl").write_bytes(b'{"text": "fine", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    refused("run_classification.py", "--data_dir", latin, *run, "--output_dir", tmp_path / "o2",
            message=f"error: {latin / 'train.jsonl'} line 2: not valid UTF-8")
    result = refused("run_classification.py", "--dataset_name", "someone/not-cached", *run, "--output_dir",
                     tmp_path / "o4", message="Without network, pass a local copy of the data with --data_dir DIR")
    assert "'someone/not-cached' is not an existing local path" in result.stderr
    assert not list(tmp_path.glob("o*/.lock"))


# ---- the converter's source ----------------------------------------------------------------

def test_converter_refuses_bad_sources_by_name(tmp_path):
    source, _ = make_source(tmp_path, "bert", "classification")
    out = ["--attention_type", "zformer", "--output_dir", tmp_path / "out"]
    refused("convert_checkpoint.py", "--model_name_or_path", tmp_path / "nowhere", *out, message="no model config")
    refused("convert_checkpoint.py", "--model_name_or_path", "someone/not-cached", *out, message="no model config",
            env={"HF_HUB_OFFLINE": "1"})
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((source / "config.json").read_text())
    refused("convert_checkpoint.py", "--model_name_or_path", config_only, *out, message="weights cannot be loaded")
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in source.iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    refused("convert_checkpoint.py", "--model_name_or_path", truncated, *out, message="weights cannot be loaded")
    refused("convert_checkpoint.py", "--model_name_or_path", source, *out, "--config_overrides", "hidden_size=64",
            message="hidden_size=64 cannot be set when converting")
    assert not (tmp_path / "out").exists()


def test_source_without_tokenizer_gets_none_and_training_refuses_it(tmp_path, tiny_data):  # noqa: F811
    """transformers builds a 5-token tokenizer for a folder without tokenizer files; the converter
    must not save it (every word would be [UNK]), distillation is refused, and a training script
    given the folder says it has no tokenizer."""
    torch.manual_seed(0)
    source, _ = make_source(tmp_path, "bert", "classification")
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        (source / name).unlink(missing_ok=True)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(["the movie was good"] * 40))
    refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer",
            "--output_dir", tmp_path / "distilled", "--distill_file", texts, "--distill_steps", 1,
            message="has no tokenizer of this model")
    assert not (tmp_path / "distilled").exists()
    run_script("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer",
               "--output_dir", tmp_path / "converted")
    assert not (tmp_path / "converted" / "tokenizer_config.json").exists()
    refused("run_classification.py", "--model_name_or_path", tmp_path / "converted", "--data_dir", tiny_data / "clf",
            "--output_dir", tmp_path / "run", message="has no tokenizer files")
    # with the tokenizer named, the converted folder gets it
    tokenizer_folder = tmp_path / "tokenizer"
    _bert_tokenizer(tokenizer_folder)
    run_script("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer",
               "--tokenizer_name", tokenizer_folder, "--output_dir", tmp_path / "with-tokenizer")
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(tmp_path / "with-tokenizer")) == 99


def test_a_bad_tokenizer_name_is_named_without_blaming_distillation(tmp_path):
    """--tokenizer_name naming a folder without this model's tokenizer, no distillation asked for:
    the message said distillation needs the tokenizer."""
    source, _ = make_source(tmp_path, "bert", "classification")
    notes = tmp_path / "notes"
    plant(notes, {"a.txt": "not a tokenizer"})
    result = refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer",
                     "--tokenizer_name", notes, "--output_dir", tmp_path / "out",
                     message=f"tokenizer_name={str(notes)!r} (--tokenizer_name) is no tokenizer of this model: ")
    assert "distillation" not in result.stderr and "pass the tokenizer the source model was trained with" in \
        result.stderr
    assert not (tmp_path / "out").exists()


def test_model_folder_without_tokenizer_is_named(tmp_path, tiny_data):  # noqa: F811
    """The README's save_pretrained("my-model") folder given to a training script."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model("zformer", attention_type="zformer", vocab_size=120, hidden_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=2)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "my-model")
    result = refused("run_classification.py", "--model_name_or_path", tmp_path / "my-model", "--data_dir",
                     tiny_data / "clf", "--output_dir", tmp_path / "run", message="has no tokenizer files")
    assert "--tokenizer_name" in result.stderr and "sentencepiece" not in result.stderr


# ---- runs: resume, divergence, float flags -------------------------------------------------

def test_a_run_never_resumes_or_extends_another_run(tmp_path, tiny_data):  # noqa: F811
    data = ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 4, "--checkpointing_steps", 2,
            "--eval_steps", 2]
    out = tmp_path / "run"
    run_script("run_classification.py", *data, "--learning_rate", 1e-3, "--output_dir", out)
    first = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    state = json.loads((out / "step_4" / "training_state.json").read_text())
    assert state["run_args"]["learning_rate"] == 1e-3
    # a new run in the same folder: refused, the earlier run named
    refused("run_classification.py", *data, "--learning_rate", 5e-4, "--output_dir", out,
            message="holds an earlier run (step_2, step_4")
    # resuming it with other arguments: refused, the difference named
    refused("run_classification.py", *data, "--learning_rate", 5e-4, "--output_dir", out,
            "--resume_from_checkpoint", "latest", message="--learning_rate 0.001 there, 0.0005 now")
    assert [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()] == first
    # --overwrite_output_dir: the earlier run's checkpoints and history are gone, the new run's alone remain
    run_script("run_classification.py", *data, "--learning_rate", 5e-4, "--max_train_steps", 2, "--output_dir", out,
               "--overwrite_output_dir")
    history = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [2] and not (out / "step_4").exists()
    state = json.loads((out / "step_2" / "training_state.json").read_text())
    assert state["run_args"]["learning_rate"] == 5e-4 and state["run_args"]["max_train_steps"] == 2


def test_a_damaged_checkpoint_is_named_before_any_work(tmp_path, tiny_data, capsys):  # noqa: F811
    """Resuming a checkpoint whose training state is not JSON or lacks a field, or whose weights or
    optimizer state are missing or truncated, was a traceback (after loading the data and the
    model); now one error line naming the file, exit code 2, while parsing."""
    import shutil

    data = ["--data_dir", str(tiny_data / "clf"), *map(str, CLF), "--max_train_steps", "2", "--checkpointing_steps", "2"]
    run_script("run_classification.py", *data, "--output_dir", tmp_path / "run")
    good = tmp_path / "run" / "step_2"
    state = json.loads((good / "training_state.json").read_text())

    def damaged(name, change):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        change(folder)
        return folder

    def cut(file):
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])

    cases = [
        (damaged("not-json", lambda f: (f / "training_state.json").write_text('{"completed_steps": 2,\n')),
         "training_state.json line 2: not valid JSON"),
        (damaged("no-steps", lambda f: (f / "training_state.json").write_text(json.dumps(
            {k: v for k, v in state.items() if k != "completed_steps"}))),
         "training_state.json: the field 'completed_steps' is missing"),
        (damaged("bad-epoch", lambda f: (f / "training_state.json").write_text(json.dumps({**state, "epoch": "one"}))),
         "training_state.json: 'epoch' is 'one', expected a count"),
        (damaged("no-weights", lambda f: (f / "model.safetensors").unlink()),
         "holds no model.safetensors (the model's weights)"),
        (damaged("no-scheduler", lambda f: (f / "scheduler.bin").unlink()), "holds no scheduler.bin"),
        (damaged("cut-optimizer", lambda f: cut(f / "optimizer.bin")),
         "optimizer.bin: truncated or damaged"),
        (damaged("cut-weights", lambda f: cut(f / "model.safetensors")), "model.safetensors: truncated or damaged"),
    ]
    clf = load_script("run_classification.py")
    for folder, message in cases:
        with pytest.raises(SystemExit) as stop:
            clf.parse_args([*data, "--output_dir", str(tmp_path / f"resumed-{folder.name}"),
                            "--resume_from_checkpoint", str(folder)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"--resume_from_checkpoint {str(folder)!r} cannot be resumed" in err, err
        assert message in err and str(folder) in err, (folder.name, err)
    clf.parse_args([*data, "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", str(good)])
    # the newest checkpoint, damaged: named as a script run sees it, nothing trained
    cut(good / "optimizer.bin")
    refused("run_classification.py", *data, "--output_dir", tmp_path / "run", "--resume_from_checkpoint", "latest",
            message=f"{good / 'optimizer.bin'}: truncated or damaged")
    assert not (tmp_path / "run" / ".lock").exists() and (tmp_path / "run" / "model.safetensors").exists()


def test_resume_latest_without_a_checkpoint_is_refused(tmp_path, tiny_data):  # noqa: F811
    refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--output_dir", tmp_path / "empty",
            "--resume_from_checkpoint", "latest", message="holds no checkpoint yet")


def test_divergence_stops_the_run_and_saves_nothing_non_finite(tmp_path, tiny_data):  # noqa: F811
    out = tmp_path / "nan"
    result = run_script_failing("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--learning_rate", 1e4,
                                "--max_grad_norm", 0, "--max_train_steps", 12, "--eval_steps", 1, "--save_best",
                                "--checkpointing_steps", 1, "--output_dir", out)
    assert result.returncode == 1 and "training diverged" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (out / "model.safetensors").exists()
    from safetensors.torch import load_file

    for folder in [out / "best", *out.glob("step_*")]:  # whatever was saved before the divergence is finite
        for name in ("model.safetensors",):
            if (folder / name).exists():
                assert all(torch.isfinite(t).all() for t in load_file(folder / name).values()), folder


def test_float_flags_reject_inf_and_nan(tmp_path, tiny_data, capsys):  # noqa: F811
    """Checked at parse time (in-process: no training starts), for every float flag."""
    clf, convert = load_script("run_classification.py"), load_script("convert_checkpoint.py")
    for flag in ("--learning_rate", "--distill_temperature", "--distill_alpha", "--weight_decay", "--max_grad_norm"):
        for value in ("inf", "nan", "-inf"):
            with pytest.raises(SystemExit) as stop:
                clf.parse_args(["--data_dir", str(tiny_data / "clf"), "--attention_type", "zformer", f"{flag}={value}",
                                "--output_dir", str(tmp_path)])
            assert stop.value.code == 2 and f"{flag} must be a finite number" in capsys.readouterr().err
    for flag, value in (("--distill_learning_rate", "inf"), ("--distill_attention_weight_loss", "nan"),
                        ("--distill_attention_weight_loss", "-1")):
        with pytest.raises(SystemExit) as stop:
            convert.parse_args(["--model_name_or_path", str(tmp_path), "--output_dir", str(tmp_path / "out"),
                                flag, value])
        assert stop.value.code == 2 and f"{flag} must be a finite number" in capsys.readouterr().err


# ---- teacher, evaluation length, unlabeled file --------------------------------------------

@pytest.fixture(scope="module")
def trained_classifier(tmp_path_factory, tiny_data):  # noqa: F811
    """A tiny classifier trained at 24 tokens (its folder), for teacher and evaluation tests."""
    out = tmp_path_factory.mktemp("clf") / "run"
    run_script("run_classification.py", "--data_dir", tiny_data / "clf", *CLF[:-4], "--max_length", 24,
               "--per_device_train_batch_size", 16, "--max_train_steps", 2, "--output_dir", out)
    return out


def test_teacher_must_be_a_trained_classifier_covering_max_length(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    from transformers import AutoConfig, AutoModelForMaskedLM

    student = ["--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf", "--max_train_steps", 1,
               "--output_dir", tmp_path / "student"]
    refused("run_classification.py", *student, "--max_length", 24, "--teacher_model_name_or_path",
            tmp_path / "no-teacher", message="no model there")
    config = AutoConfig.from_pretrained(trained_classifier)
    AutoModelForMaskedLM.from_config(config).save_pretrained(tmp_path / "mlm")
    refused("run_classification.py", *student, "--max_length", 24, "--teacher_model_name_or_path", tmp_path / "mlm",
            message="is not a trained classifier")
    short = AutoConfig.from_pretrained(trained_classifier, max_position_embeddings=16)
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_config(short).save_pretrained(tmp_path / "short")
    refused("run_classification.py", *student, "--max_length", 24, "--teacher_model_name_or_path", tmp_path / "short",
            message="holds 16 tokens")


def test_evaluation_truncates_where_training_did(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    config = json.loads((trained_classifier / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 24
    run_script("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
               "--split", "validation", "--output_dir", tmp_path / "eval", "--results_file", tmp_path / "r.json")
    results = json.loads((tmp_path / "eval" / "validation_results.json").read_text())
    assert results["max_length"] == 24
    record, = json.loads((tmp_path / "r.json").read_text())
    assert record["split"] == "validation" and record["max_length"] == 24 and record["samples"] == results[
        "validation_samples"]
    assert record["value"] == pytest.approx(100 * results["validation_accuracy"])
    assert len(record["ci95"]) == 2 and record["scored_by"] == "evaluate_model.py"


def test_unlabeled_file_without_texts_is_named(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    result = run_script_failing("run_classification.py", "--model_name_or_path", trained_classifier, "--data_dir",
                                tiny_data / "clf", "--teacher_model_name_or_path", trained_classifier,
                                "--unlabeled_file", blank, "--output_dir", tmp_path / "s")
    assert "no texts in it" in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]


# ---- causal LM: the wrong folder, generation -----------------------------------------------

def test_causal_lm_script_refuses_a_classifier_folder(tmp_path, trained_classifier):
    docs = tmp_path / "docs.txt"
    docs.write_text("\n".join(f"document {i} about a film and its music" for i in range(60)))
    result = refused("run_clm.py", "--model_name_or_path", trained_classifier, "--train_file", docs,
                     "--output_dir", tmp_path / "clm", message="is not a checkpoint this script can continue from")
    assert "ZformerForSequenceClassification" in result.stderr


def test_generation_refuses_empty_prompts_and_lengths_past_the_positions():
    config = hf_zformer.ZformerConfig(attention_type="zformer", vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32, max_position_embeddings=20,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(ValueError, match="at most 15 new tokens"):
        model.generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=16)
    with pytest.raises(ValueError, match="max_length=50"):
        model.generate(torch.ones(1, 5, dtype=torch.long), max_length=50)
    for prompt in (20, 25):  # no room left: the prompt is named, not "at most 0 new tokens"
        for asked in ({}, {"max_new_tokens": 3}):
            with pytest.raises(ValueError, match=f"a prompt of {prompt} tokens, but the model holds 20 positions "
                                                 r"\(max_position_embeddings=20\): shorten the prompt to at most 19"):
                model.generate(torch.ones(1, prompt, dtype=torch.long), **asked)
    assert model.generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=15, eos_token_id=None).shape == (1, 20)
    model.generation_config.max_length = None  # the library default (20 tokens), cut to the positions
    assert model.generate(torch.ones(1, 5, dtype=torch.long), eos_token_id=None).shape[1] <= 20


def test_the_pipelines_default_length_is_named_as_the_pipelines():
    """transformers' text-generation pipeline asks for 256 new tokens when its call names no length:
    the refusal says where the 256 comes from and how to ask for fewer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, pipeline

    words = "<pad> <s> </s> <unk> good bad movie plot".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    config = hf_zformer.ZformerConfig(attention_type="zformer", vocab_size=len(words), hidden_size=16,
                                      num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    generator = pipeline("text-generation", model=AutoModelForCausalLM.from_config(config).eval(), tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"max_new_tokens=256\).*text-generation pipeline asks for when its call "
                                         r"names no length: pass max_new_tokens"):
        generator("good movie")
    assert generator("good movie", max_new_tokens=5, do_sample=False)[0]["generated_text"].startswith("good movie")
    with pytest.raises(ValueError) as refused:  # a length the user asked for is not blamed on the pipeline
        AutoModelForCausalLM.from_config(config).generate(torch.ones(1, 5, dtype=torch.long), max_new_tokens=100)
    assert "pipeline" not in str(refused.value)


# ---- report files of the benchmark and report scripts ------------------------------------------

def test_benchmark_reports_never_overwrite_a_users_file(tmp_path):
    """A benchmark writes <output>.csv/.json/.md/.png: into a folder of the user's files it adds its
    own and lists them in the marker, a re-run replaces them, and a file of the user's with one of
    those names stops the run before any work, untouched."""
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("mine")
    (folder / "speed.md").write_text("my own table")
    small = ["--lengths", 8, "--widths", 16, "--heads", 2, "--batch", 1, "--types", "full", "zformer", "--repeats", 1,
             "--warmup", 0, "--no_memory", "--no_plot", "--no_progress", "--matmul_size", 64]
    refused("benchmark_attention.py", *small, "--output", folder / "speed", message="would overwrite speed.md")
    assert (folder / "speed.md").read_text() == "my own table" and not (folder / "speed.json").exists()
    for _ in range(2):  # the second run replaces the reports the first wrote
        run_script("benchmark_attention.py", *small, "--output", folder / "bench")
    assert {"bench.csv", "bench.json", "bench.md"} <= set(json.loads((folder / ".hf_zformer-output.json").read_text())["files"])
    assert (folder / "todo.txt").read_text() == "mine" and (folder / "speed.md").read_text() == "my own table"


@pytest.mark.parametrize("script, argv", [
    ("benchmark_kernels.py", ["--device", "cpu"]),
    ("benchmark_generation.py", []),
    ("benchmark_linear.py", []),
    ("plot_curves.py", None),
    ("loss_by_position.py", None),
])
def test_every_report_script_refuses_to_overwrite_a_users_file(script, argv, tmp_path):
    (tmp_path / "mine.md").write_text("mine")
    (tmp_path / "mine.png").write_text("mine")
    module = load_script(script)
    if script == "plot_curves.py":
        run = tmp_path / "run"
        run.mkdir()
        (run / "eval_history.jsonl").write_text("")
        argv = [str(run), "--output", str(tmp_path / "mine.png")]
    elif script == "loss_by_position.py":
        argv = ["--model_name_or_path", str(tmp_path), "--data_dir", str(tmp_path), "--output", str(tmp_path / "mine.json")]
    else:
        argv = argv + ["--output", str(tmp_path / ("mine.md" if script == "benchmark_linear.py" else "mine"))]
    with pytest.raises(SystemExit) as stopped:
        module.parse_args(argv)
    assert stopped.value.code == 2
    assert (tmp_path / "mine.md").read_text() == "mine" and (tmp_path / "mine.png").read_text() == "mine"


# ---- the library writes only names it owns, never through a link, and whole -------------------

@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory, tiny_data):  # noqa: F811
    """A finished 4-step run with checkpoints step_2 and step_4 (copied by the tests that change it)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    run_script("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 4,
               "--checkpointing_steps", 2, "--output_dir", out)
    return out


def marked(folder, **files):
    """A folder the library wrote (its marker listing ``files``, {name: text}, written as they are)."""
    folder.mkdir(parents=True, exist_ok=True)
    plant(folder, files)
    record(folder, *files)
    return folder


def test_a_users_file_under_a_name_the_library_writes_stops_the_run(tmp_path, tiny_data,  # noqa: F811
                                                                    trained_classifier):
    """In a folder the library wrote, the user's README.md (the model card's name), .lock and
    test_predictions.jsonl are refused before any work: not replaced, truncated or deleted."""
    out = marked(tmp_path / "run", **{"all_results.json": "{}"})
    for name in ("README.md", ".lock"):
        planted = plant(out, {name: "the user's " + name})
        refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1,
                "--output_dir", out, "--overwrite_output_dir", message=f"holds {name}, which this run would write")
        assert_kept(out, planted)
        (out / name).unlink()
    evaluation = marked(tmp_path / "eval", **{"validation_results.json": "{}"})
    planted = plant(evaluation, {"test_predictions.jsonl": "mine\n", "validation_predictions.jsonl": "mine\n"})
    result = refused("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
                     "--output_dir", evaluation, message="holds validation_predictions.jsonl, which this run would")
    assert "evaluate: done" not in result.stderr  # before the evaluation
    assert_kept(evaluation, planted)


def test_writes_never_go_through_a_link(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """run/README.md -> ../outside/notes.md (and the same through test_predictions.jsonl,
    all_results.json and --results_file): refused, the file outside and the link unchanged."""
    outside = plant(tmp_path / "outside", {"notes.md": "my notes", "r.json": "[]", "r.json.lock": "mine"})
    out = marked(tmp_path / "run", **{"README.md": "card", "all_results.json": "{}"})
    for name in ("README.md", "all_results.json"):
        (out / name).unlink()
        (out / name).symlink_to(tmp_path / "outside" / "notes.md")
        refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1,
                "--output_dir", out, "--resume_from_checkpoint", "latest", message=f"{name} is a symbolic link")
        assert os.readlink(out / name) == str(tmp_path / "outside" / "notes.md")
    evaluation = marked(tmp_path / "eval")
    (evaluation / "test_predictions.jsonl").symlink_to(tmp_path / "outside" / "notes.md")
    evaluate = ["--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf"]
    refused("evaluate_model.py", *evaluate, "--split", "test", "--output_dir", evaluation,
            message="test_predictions.jsonl is a symbolic link")
    (tmp_path / "link.json").symlink_to(tmp_path / "outside" / "r.json")
    (tmp_path / "other.json.lock").symlink_to(tmp_path / "outside" / "r.json.lock")
    for results_file in ("link.json", "other.json"):
        refused("evaluate_model.py", *evaluate, "--output_dir", tmp_path / "eval2", "--results_file",
                tmp_path / results_file, message="is a symbolic link")
    assert_kept(tmp_path / "outside", outside)


def test_the_results_files_lock_of_the_user_is_never_truncated(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    (tmp_path / "res.json.lock").write_text("the user's lock notes")
    run_script("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
               "--output_dir", tmp_path / "eval", "--results_file", tmp_path / "res.json")
    assert (tmp_path / "res.json.lock").read_text() == "the user's lock notes"
    assert len(json.loads((tmp_path / "res.json").read_text())) == 1


def without_markers(run):
    """``run`` as a version without markers left it."""
    for marker in run.rglob(".hf_zformer-output.json"):
        marker.unlink()


def test_a_folder_without_marker_is_adopted_only_when_every_file_is_the_librarys(tmp_path, tiny_data,  # noqa: F811
                                                                                 checkpointed_run):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(checkpointed_run, out)
    without_markers(out)
    for file in out.iterdir():  # a run killed before its end: its checkpoints and history
        if file.is_file() and file.name != "eval_history.jsonl":
            file.unlink()
    data = ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 4, "--checkpointing_steps", 2]
    planted = plant(out, {"step_4/photo.jpg": "the user's photo"})
    refused("run_classification.py", *data, "--output_dir", out, "--resume_from_checkpoint", out / "step_2",
            message="step_4/photo.jpg in it is not a file this library writes")
    assert_kept(out, planted)
    (out / "step_4" / "photo.jpg").unlink()
    (out / "README.md").write_text("the user's readme")
    refused("run_classification.py", *data, "--output_dir", out, "--resume_from_checkpoint", out / "step_2",
            message="holds README.md, which this run would write")
    assert (out / "README.md").read_text() == "the user's readme" and not (out / ".hf_zformer-output.json").exists()
    (out / "README.md").unlink()
    run_script("run_classification.py", *data, "--output_dir", out, "--resume_from_checkpoint", out / "step_2")
    assert {"step_2/optimizer.bin", "step_4/optimizer.bin", "README.md"} <= set(
        json.loads((out / ".hf_zformer-output.json").read_text())["files"])  # adopted, then written as its own


def test_data_is_refused_as_an_output_in_every_script(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """An earlier evaluation's predictions, given as training data with --output_dir the folder
    holding them and --overwrite_output_dir: refused, not deleted before it is read."""
    out = marked(tmp_path / "out", **{"test_predictions.jsonl": "\n".join(
        json.dumps({"text": f"document {i} about a film"}) for i in range(40)) + "\n"})
    before = tree(out)
    refused("run_clm.py", "--train_file", out / "test_predictions.jsonl", "--attention_type", "zformer",
            "--output_dir", out, "--overwrite_output_dir", message="contains --train_file")
    refused("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
            "--output_dir", tiny_data / "clf", message="is --data_dir")
    source, _ = make_source(tmp_path, "bert", "classification")
    refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer", "--output_dir",
            out, "--overwrite", "--distill_file", out / "test_predictions.jsonl", message="contains --distill_file")
    assert tree(out) == before


# a file-size limit makes every write past its first 40 kB fail with EFBIG, also as root (where a
# read-only folder still takes writes): the weights (some 50 kB) cannot be written, the logs can
FILE_SIZE_LIMIT = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))
"""


def test_a_failed_final_write_leaves_no_partial_model_and_one_error_line(tmp_path, tiny_data):  # noqa: F811
    out = tmp_path / "run"
    result = warm_scripts.run(Path(__file__).resolve().parents[1] / "scripts" / "run_classification.py",
                              ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1, "--output_dir", out],
                              Path(__file__).resolve().parents[1], offline_env(), offline_env(), 600, FILE_SIZE_LIMIT)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    error, = [line for line in stderr.splitlines() if "error:" in line]
    assert "the final model was not saved: cannot write" in error and "EFBIG, errno 27" in error, error
    assert str(out) in error
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    # what the run wrote before the end (its tokenizer, its evaluations) stays; no staged or temporary file
    assert sorted(p.name for p in out.iterdir()) == [".hf_zformer-output.json", "eval_history.jsonl", "tokenizer.json",
                                                     "tokenizer_config.json"]


KILLED_AFTER_CONFIG = """
import os, transformers
saving = transformers.PretrainedConfig.save_pretrained
def save_and_die(self, *args, **kwargs):
    saving(self, *args, **kwargs)
    os._exit(9)  # killed right after config.json
transformers.PretrainedConfig.save_pretrained = save_and_die
"""


def test_a_run_killed_after_config_json_leaves_no_folder_that_looks_like_a_model(tmp_path, tiny_data):  # noqa: F811
    out = tmp_path / "run"
    result = warm_scripts.run(Path(__file__).resolve().parents[1] / "scripts" / "run_classification.py",
                              ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1, "--output_dir", out],
                              Path(__file__).resolve().parents[1], offline_env(), offline_env(), 600, KILLED_AFTER_CONFIG)
    assert result.returncode == 9
    assert not (out / "config.json").exists() and len(list(out.glob(".hf_zformer-staging-final-*"))) == 1
    refused("evaluate_model.py", "--model_name_or_path", out, "--data_dir", tiny_data / "clf", "--output_dir",
            tmp_path / "eval", message="is not a saved model")


READ_ONLY = """
import errno, os
real_open = os.open
def read_only(path, flags, *args, **kwargs):
    if flags & os.O_CREAT and os.fspath(path).startswith({folder!r}):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
    return real_open(path, flags, *args, **kwargs)
os.open = read_only
"""


def test_evaluation_into_a_folder_that_takes_no_write_fails_before_the_evaluation(tmp_path, tiny_data,  # noqa: F811
                                                                                trained_classifier):
    """A read-only file system (simulated: os.open refuses to create files there; as root a chmod
    would not stop the writes) is named with the errno while parsing, nothing evaluated."""
    folder = marked(tmp_path / "ro", **{"notes.txt": "mine"})
    result = warm_scripts.run(Path(__file__).resolve().parents[1] / "scripts" / "evaluate_model.py",
                              ["--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
                               "--output_dir", folder], Path(__file__).resolve().parents[1],
                              offline_env(), offline_env(), 600, READ_ONLY.format(folder=str(folder)))
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert f"cannot write {folder}" in stderr and "EROFS, errno 30" in stderr and "evaluate: done" not in stderr
    assert sorted(p.name for p in folder.iterdir()) == [".hf_zformer-output.json", "notes.txt"]


class RunsCode:
    """A pickle that runs code when loaded without weights_only: it creates the file ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl", "pytorch_model.bin"])
def test_a_checkpoint_pickle_that_would_run_code_is_refused_by_name(tmp_path, tiny_data, checkpointed_run, name,  # noqa: F811
                                                                    capsys):
    import shutil

    checkpoint = tmp_path / "step_2"
    shutil.copytree(checkpointed_run / "step_2", checkpoint)
    canary = tmp_path / "code-ran"
    torch.save({"state": RunsCode(canary)}, checkpoint / name)
    clf = load_script("run_classification.py")
    with pytest.raises(SystemExit) as stop:
        clf.parse_args(["--data_dir", str(tiny_data / "clf"), *map(str, CLF), "--max_train_steps", "4",
                        "--checkpointing_steps", "2", "--output_dir", str(tmp_path / "resumed"),
                        "--resume_from_checkpoint", str(checkpoint)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"{checkpoint / name}: holds objects other than tensors" in err, err
    error, = [line for line in err.splitlines() if "error:" in line]  # one line, no traceback
    assert "Unsupported global" in error and "weights_only=False" not in error and not canary.exists(), error


def test_a_random_state_without_the_generators_is_refused(tmp_path, tiny_data, checkpointed_run, capsys):  # noqa: F811
    """accelerate would log "Could not load random states" at INFO and go on without them."""
    import shutil

    checkpoint = tmp_path / "step_2"
    shutil.copytree(checkpointed_run / "step_2", checkpoint)
    torch.save({"step": 0}, checkpoint / "random_states_0.pkl")
    clf = load_script("run_classification.py")
    with pytest.raises(SystemExit) as stop:
        clf.parse_args(["--data_dir", str(tiny_data / "clf"), *map(str, CLF), "--max_train_steps", "4",
                        "--checkpointing_steps", "2", "--output_dir", str(tmp_path / "resumed"),
                        "--resume_from_checkpoint", str(checkpoint)])
    assert stop.value.code == 2 and "random_states_0.pkl: holds no random-generator state" in capsys.readouterr().err


def test_a_second_converter_leaves_the_staging_folder_of_a_running_one(tmp_path):
    """Two `--overwrite` conversions into one folder: the one starting second keeps the staging
    folder the first is writing (locked while it writes), and removes one whose writer died."""
    from hf_zformer import folders

    source, _ = make_source(tmp_path, "bert", "classification")
    convert = ["--model_name_or_path", source, "--attention_type", "zformer", "--output_dir", tmp_path / "out",
               "--overwrite"]
    running = staging_dir(tmp_path, "out")  # this process is the first converter, still writing
    dead = staging_dir(tmp_path, "out")
    folders._let_go(dead)  # its writer is gone
    try:
        run_script("convert_checkpoint.py", *convert)
        assert running.is_dir() and (running / ".hf_zformer-output.json").is_file() and not dead.exists()
        assert (tmp_path / "out" / "config.json").is_file()
    finally:
        folders.discard(running)


# ---- silently wrong before: cut, refused or recorded as it ran -------------------------------

MT = ["--attention_type", "zformer", "--config_overrides", TINY_MT, "--vocab_size", 120, "--per_device_train_batch_size", 16]


def test_lengths_past_the_positions_are_cut_with_a_warning(tmp_path, tiny_data):  # noqa: F811
    """run_classification and run_translation warn as run_clm and run_mlm do, and train at the cut length."""
    result = run_script("run_classification.py", "--data_dir", tiny_data / "clf", *CLF[:3],
                        TINY_CLF + ",max_position_embeddings=8,position_offset=2", *CLF[4:], "--max_train_steps", 1,
                        "--output_dir", tmp_path / "clf")
    assert ("--max_length 32 > the model's 6 positions (max_position_embeddings=8 less position_offset=2): cut to 6 "
            "tokens") in result.stderr, result.stderr[-3000:]
    assert json.loads((tmp_path / "clf" / "tokenizer_config.json").read_text())["model_max_length"] == 6
    result = run_script("run_translation.py", "--data_dir", tiny_data / "mt", *MT[:3], TINY_MT + ",max_position_embeddings=8",
                        *MT[4:], "--max_source_length", 32, "--max_target_length", 16, "--max_train_steps", 1,
                        "--max_eval_samples", 2, "--output_dir", tmp_path / "mt")
    for flag, asked in (("--max_source_length", 32), ("--max_target_length", 16)):
        assert f"{flag} {asked} > the model's 8 positions (max_position_embeddings=8): cut to 8 tokens" in result.stderr


def test_data_of_one_class_is_refused(tmp_path):
    """Every label 0 made num_labels=1, which is regression (MSE), with exit code 0."""
    plant(tmp_path / "one", {"train.jsonl": "".join(json.dumps({"text": f"text {i}", "label": 0}) + "\n"
                                                    for i in range(40))})
    refused("run_classification.py", "--data_dir", tmp_path / "one", *CLF, "--output_dir", tmp_path / "o",
            message="every label is 0, which makes 1 class; a classifier needs at least 2")


@pytest.mark.parametrize("override, message", [
    ("initializer_range=-0.02", "initializer_range=-0.02 must be a non-negative number"),
    ("hidden_act=foo", "hidden_act='foo' is not an activation transformers knows"),
    ("problem_type=regression", "problem_type='regression': this script trains single-label classification"),
    ("problem_type=multi_label_classification", "problem_type='multi_label_classification': this script trains"),
    ("return_dict=false", "return_dict=False: the scripts read the model's outputs by name"),
    ("id2label=foo", "config field 'id2label' is a mapping, which --config_overrides cannot write"),
    ("is_encoder_decoder=true", "is_encoder_decoder=True: this script's model is no encoder-decoder"),
    ("vocab_size=50", "vocab_size=50 is below the tokenizer's 120 tokens"),
    ("pad_token_id=3", "pad_token_id=3, but the tokenizer pads with id 0"),
])
def test_classifier_config_values_that_would_fail_later_are_refused(tmp_path, tiny_data, override, message):  # noqa: F811
    """Each passed the config's validation, then crashed or trained something else; refused while parsing."""
    result = refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF[:3], f"{TINY_CLF},{override}",
                     *CLF[4:], "--output_dir", tmp_path / "o", message=f"invalid model configuration: {message}")
    assert result.stderr.count("error:") == 1 and not (tmp_path / "o").exists()


def test_config_values_the_given_tokenizer_cannot_take_are_refused(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """With --tokenizer_name the tokenizer's size and pad id are known once it is loaded: before any training."""
    for override, message in (("vocab_size=50", "vocab_size=50 is below the tokenizer's"),
                              ("pad_token_id=3", "pad_token_id=3, but the tokenizer pads with id 0")):
        refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF[:3], f"{TINY_CLF},{override}",
                "--tokenizer_name", trained_classifier, "--max_train_steps", 1, "--output_dir", tmp_path / override,
                message=f"invalid model configuration: {message}")
        assert not list((tmp_path / override).glob("*.safetensors"))


def test_translation_refuses_no_decoder_layers_and_a_tokenizer_without_pad(tmp_path, tiny_data):  # noqa: F811
    """No decoder layer means no cross-attention: the output ignored the source. A tokenizer
    without a pad token was a traceback."""
    refused("run_translation.py", "--data_dir", tiny_data / "mt", *MT[:3], TINY_MT + ",num_decoder_layers=0", *MT[4:],
            "--output_dir", tmp_path / "o", message="num_decoder_layers=0: a translation model needs at least one "
            "decoder layer")
    with pytest.raises(ValueError, match="num_decoder_layers=0: an encoder-decoder needs at least one decoder layer"):
        from transformers import AutoModelForSeq2SeqLM

        AutoModelForSeq2SeqLM.from_config(hf_zformer.ZformerConfig(num_decoder_layers=0))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "<s> </s> <unk> ein mann hund a man dog".split()
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(tmp_path / "no-pad")
    refused("run_translation.py", "--data_dir", tiny_data / "mt", *MT, "--tokenizer_name", tmp_path / "no-pad",
            "--output_dir", tmp_path / "o2", message=f"the tokenizer of {tmp_path / 'no-pad'} has no pad token")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusals: a GPU runs fp16")
@pytest.mark.parametrize("precision, message", [
    ("fp16", "--mixed_precision fp16 needs a GPU: on the CPU accelerate would run fp32 and record it as fp16"),
    ("fp8", "--mixed_precision fp8 needs an NVIDIA GPU of compute capability 8.9 or newer"),
])
def test_a_precision_the_machine_cannot_run_is_refused(tmp_path, tiny_data, precision, message):  # noqa: F811
    """fp16 on the CPU ran fp32 and recorded "fp16"; fp8 was a traceback."""
    refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--output_dir", tmp_path / "o",
            env={"ACCELERATE_MIXED_PRECISION": precision}, message=message)
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_a_source_model_with_a_nan_weight_is_named_not_called_a_divergence(tmp_path, tiny_data,  # noqa: F811
                                                                            trained_classifier):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(trained_classifier, broken)
    weights = load_file(broken / "model.safetensors")
    name = next(key for key in weights if key.endswith("classifier.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    for script, extra in (("run_classification.py", ["--max_train_steps", 1]), ("evaluate_model.py", [])):
        result = refused(script, "--model_name_or_path", broken, "--data_dir", tiny_data / "clf", *extra,
                         "--output_dir", tmp_path / script, message=f"its parameter {name} holds NaN or infinite "
                         "values, so the model it loads is broken before any training")
        assert "diverged" not in result.stderr and "--learning_rate" not in result.stderr


def test_evaluation_refuses_a_model_that_is_not_its_folders(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """Each was scored with exit code 0: weights that did not load (a causal LM read as a classifier,
    a config edited after training), or a 2-class head scored on labels 0..3."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    evaluation = ["--data_dir", tiny_data / "clf", "--split", "train"]
    causal = tmp_path / "causal"
    shutil.copytree(trained_classifier, causal)
    (causal / "model.safetensors").unlink()
    config = AutoConfig.from_pretrained(trained_classifier)
    AutoModelForCausalLM.from_config(config).save_pretrained(causal)
    refused("evaluate_model.py", "--model_name_or_path", causal, *evaluation, "--output_dir", tmp_path / "e1",
            message="(ZformerForCausalLM) does not load as a ZformerForSequenceClassification: ")
    edited = tmp_path / "edited"
    shutil.copytree(trained_classifier, edited)
    saved = json.loads((edited / "config.json").read_text())
    assert saved["attention_type"] == "zformer"
    (edited / "config.json").write_text(json.dumps({**saved, "attention_type": "fastformer"}))
    result = refused("evaluate_model.py", "--model_name_or_path", edited, *evaluation, "--output_dir", tmp_path / "e2",
                     message="weights missing (initialised at random)")
    assert "a config.json edited after training" in result.stderr
    (edited / "config.json").write_text(json.dumps({**saved, "intermediate_size": 48}))
    refused("evaluate_model.py", "--model_name_or_path", edited, *evaluation, "--output_dir", tmp_path / "e2",
            message="weights of another shape than the config's (e.g. zformer.encoder.layers.0.feed_forward")
    plant(tmp_path / "four", {"train.jsonl": "".join(json.dumps({"text": f"movie {i}", "label": i % 4}) + "\n"
                                                     for i in range(40))})
    refused("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tmp_path / "four",
            "--split", "train", "--output_dir", tmp_path / "e3",
            message=f"--split 'train' holds labels up to 3, but --model_name_or_path {str(trained_classifier)!r} has "
                    "2 classes (0..1): its head does not fit these labels")
    assert not any((tmp_path / name / "train_results.json").exists() for name in ("e1", "e2", "e3"))


# ---- the marker's own writes, links inside checkpoints, results files the run writes itself --

def test_the_markers_temporary_file_never_writes_a_users_file_or_through_a_link(tmp_path, tiny_data):  # noqa: F811
    """The marker is written through a new file of a unique name: a user's file named
    .hf_zformer-output.json.tmp, or a link of that name to a file outside, stays as it was."""
    outside = plant(tmp_path / "outside", {"notes.txt": "my notes"})
    out = marked(tmp_path / "run", **{"all_results.json": "{}"})
    planted = plant(out, {"sub/.hf_zformer-output.json.tmp": "mine too"})
    (out / ".hf_zformer-output.json.tmp").symlink_to(tmp_path / "outside" / "notes.txt")
    run_script("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1,
               "--output_dir", out, "--overwrite_output_dir")
    assert_kept(tmp_path / "outside", outside)
    assert_kept(out, planted)
    assert os.readlink(out / ".hf_zformer-output.json.tmp") == str(tmp_path / "outside" / "notes.txt")
    assert (out / "config.json").is_file()


def test_a_link_or_users_file_in_a_checkpoint_stops_an_overwrite_or_resume_before_any_work(  # noqa: F811
        tmp_path, tiny_data, checkpointed_run):
    """The library never writes a link, so a checkpoint's file replaced by a link (to a file
    outside) is not the library's: --overwrite_output_dir would delete it, a resume would replace
    the checkpoint holding it. Both are refused before any work, as a user's file there is."""
    import shutil

    outside = plant(tmp_path / "outside", {"notes.txt": "my notes"})
    data = ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 4, "--checkpointing_steps", 2]
    for step, flags in (("step_2", ["--overwrite_output_dir"]), ("step_4", ["--resume_from_checkpoint", "step_2"])):
        out = tmp_path / f"run-{step}"
        shutil.copytree(checkpointed_run, out)
        flags = [out / f if f == "step_2" else f for f in flags]
        (out / step / "optimizer.bin").unlink()
        (out / step / "optimizer.bin").symlink_to(tmp_path / "outside" / "notes.txt")
        before = tree(out)
        result = refused("run_classification.py", *data, "--output_dir", out, *flags,
                         message=f"({step}/optimizer.bin)")
        assert "training" not in result.stdout.lower() and tree(out) == before
    out = tmp_path / "run-step_4"
    (out / "step_4" / "optimizer.bin").unlink()
    planted = plant(out, {"step_4/notes.txt": "mine"})
    refused("run_classification.py", *data, "--output_dir", out, "--resume_from_checkpoint", out / "step_2",
            message="in folders a resumed run replaces (step_4/notes.txt)")
    assert_kept(out, planted)
    assert_kept(tmp_path / "outside", outside)


def test_a_results_file_that_the_run_writes_itself_is_refused_before_any_work(tmp_path, tiny_data,  # noqa: F811
                                                                               trained_classifier):
    """--results_file out/all_results.json (or another name the run writes in --output_dir) was
    found not to be a list of records only after the whole run."""
    for name in ("all_results.json", "README.md", "step_1/r.json"):
        result = refused("run_classification.py", "--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1,
                         "--output_dir", tmp_path / "run", "--results_file", tmp_path / "run" / name,
                         message="a file the run writes itself")
        assert not (tmp_path / "run").exists(), result.stderr
    refused("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
            "--output_dir", tmp_path / "eval", "--results_file", tmp_path / "eval" / "validation_results.json",
            message="a file the run writes itself")
    run_script("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir", tiny_data / "clf",
               "--output_dir", tmp_path / "eval", "--results_file", tmp_path / "eval" / "records.json")
    assert len(json.loads((tmp_path / "eval" / "records.json").read_text())) == 1


@pytest.mark.parametrize("script, override, message", [
    ("run_classification.py", "dtype=bfloat16", "config field 'dtype' is set by the library"),
    ("run_classification.py", "architectures=Foo", "config field 'architectures' is set by the library"),
    ("run_classification.py", "transformers_version=0.0.1", "config field 'transformers_version' is set by the library"),
    ("run_translation.py", "is_encoder_decoder=false", "is_encoder_decoder=False: a translation model is an encoder-"),
])
def test_config_fields_the_library_sets_are_refused(tmp_path, tiny_data, script, override, message):  # noqa: F811
    """Each was accepted with exit code 0 and not kept: save_pretrained wrote its own value
    (architectures, transformers_version, is_encoder_decoder), or the weights trained and were saved
    in bfloat16 while the records said fp32 (dtype)."""
    if script == "run_classification.py":
        data = ["--data_dir", tiny_data / "clf", *CLF[:3], f"{TINY_CLF},{override}", *CLF[4:]]
    else:
        data = ["--data_dir", tiny_data / "mt", *MT[:3], f"{TINY_MT},{override}", *MT[4:]]
    result = refused(script, *data, "--max_train_steps", 1, "--output_dir", tmp_path / "o",
                     message=f"invalid model configuration: {message}")
    assert result.stderr.count("error:") == 1 and not (tmp_path / "o").exists()


def test_a_precision_accelerate_does_not_know_is_refused(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """ACCELERATE_MIXED_PRECISION=foo trained fp32 with exit code 0 and recorded "mixed_precision": "foo"."""
    for script, args in (("run_classification.py", ["--data_dir", tiny_data / "clf", *CLF, "--max_train_steps", 1]),
                         ("evaluate_model.py", ["--model_name_or_path", trained_classifier, "--data_dir",
                                                tiny_data / "clf"])):
        refused(script, *args, "--output_dir", tmp_path / script, env={"ACCELERATE_MIXED_PRECISION": "foo"},
                message="--mixed_precision 'foo' (ACCELERATE_MIXED_PRECISION) is none of no, fp16, bf16, fp8")
        assert not (tmp_path / script / "all_results.json").exists()
        assert not (tmp_path / script / "validation_results.json").exists()


def test_the_training_file_as_validation_file_is_refused(tmp_path):
    """run_clm.py --validation_file the training file scored the training texts as validation, exit 0."""
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"document {i} about a film"}) + "\n" for i in range(40)))
    for script in ("run_clm.py", "run_mlm.py"):
        refused(script, "--train_file", texts, "--validation_file", tmp_path / "." / "texts.jsonl", "--attention_type",
                "zformer", "--output_dir", tmp_path / "out", message="is --train_file: the validation would score")
        assert not (tmp_path / "out").exists()


def test_the_converter_refuses_a_classifier_of_one_class(tmp_path):
    """--num_labels 1 made a one-class classifier, a regression on the labels (MSE), with exit code 0."""
    source, _ = make_source(tmp_path, "bert", "classification")
    refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer", "--num_labels", 1,
            "--output_dir", tmp_path / "out", message="--num_labels must be >= 2, got 1")
    assert not (tmp_path / "out").exists()


def test_a_model_whose_weights_do_not_load_is_named_in_one_line(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """A pickle in pytorch_model.bin (its code not run), a truncated model.safetensors or a missing
    shard: one error line naming the folder, not the loader's traceback (evaluate_model.py, a warm
    start, the converter)."""
    import shutil

    canary = tmp_path / "code-ran"
    pickled, truncated, sharded = (tmp_path / name for name in ("pickled", "truncated", "sharded"))
    for folder in (pickled, truncated, sharded):
        shutil.copytree(trained_classifier, folder)
    (pickled / "model.safetensors").unlink()
    torch.save({"state": RunsCode(canary)}, pickled / "pytorch_model.bin")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[:-64])
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"classifier.weight": "model-00002-of-00002.safetensors"}}))
    for folder, why in ((pickled, "holds objects other than tensors and plain values (WeightsUnpickler error"),
                        (truncated, "SafetensorError"), (sharded, "model-00002-of-00002.safetensors")):
        for script, args in (("evaluate_model.py", ["--data_dir", tiny_data / "clf"]),
                             ("run_classification.py", ["--data_dir", tiny_data / "clf", "--max_train_steps", 1])):
            result = refused(script, "--model_name_or_path", folder, *args, "--output_dir", tmp_path / "out",
                             message=f"--model_name_or_path {str(folder)!r}: its weights cannot be loaded (")
            error, = [line for line in result.stderr.splitlines() if "error:" in line]
            assert why in error and "weights_only=False" not in error, error
    assert not canary.exists()
    source, _ = make_source(tmp_path, "bert", "classification")
    (source / "model.safetensors").unlink()
    torch.save({"state": RunsCode(canary)}, source / "pytorch_model.bin")
    result = refused("convert_checkpoint.py", "--model_name_or_path", source, "--attention_type", "zformer",
                     "--output_dir", tmp_path / "converted", message="it is not unpickled, as it could run code")
    assert "weights_only=False" not in result.stderr and not canary.exists()


def test_linearize_names_a_bad_configuration_or_blocks_longer_than_the_texts_in_one_line(tmp_path):
    """An unknown field, a value the config refuses, one attention type per layer of another count, or
    blocks longer than the texts ended in a traceback once the source had loaded."""
    from test_decoder_transfer import _word_tokenizer
    from test_llama_decoder import tiny_llama

    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "llama")
    _word_tokenizer().save_pretrained(tmp_path / "llama")
    (tmp_path / "texts.txt").write_text(" ".join(f"w{i % 92}" for i in range(400)) + "\n")
    common = ["--model_name_or_path", tmp_path / "llama", "--train_file", tmp_path / "texts.txt", "--eval_file",
              tmp_path / "texts.txt", "--steps", 1, "--block_size", 16, "--eval_block_size", 32, "--eval_blocks", 1]
    configuration = "invalid model configuration (--attention_type, --config_overrides): "
    for flags, message in ((["--config_overrides", "foo=1"], configuration + "unknown config field 'foo'"),
                           (["--config_overrides", "attention_window=-4"], configuration + "attention_window=-4 must"),
                           (["--attention_type", "zformer", "full"], configuration + "attention_type has 2 entries"),
                           (["--block_size", 100000], "the training documents hold"),
                           (["--eval_block_size", 100000], "tokens make no block of 100000")):
        out = tmp_path / f"out-{flags[0]}-{flags[-1]}"
        result = refused("linearize_decoder.py", *common, *flags, "--output_dir", out, message=message)
        assert result.stderr.count("error:") == 1
        assert not (out / "transfer_state.safetensors").exists()


def test_a_staging_folder_whose_marker_cannot_be_written_is_not_left(tmp_path, monkeypatch):
    """The disk full (or a read-only folder) when a staging folder's marker is written: the write
    fails with the errno, and no unmarked staging folder, which nothing would ever clean, is left."""
    import errno
    import tempfile

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(OSError, match="No space left on device"):
        staging_dir(tmp_path, "final")
    assert list(tmp_path.iterdir()) == []


def test_evaluation_cuts_a_length_past_the_positions_with_a_warning(tmp_path, tiny_data, trained_classifier):  # noqa: F811
    """evaluate_model.py --max_length 100000 cut to the model's 512 positions without a word."""
    result = run_script("evaluate_model.py", "--model_name_or_path", trained_classifier, "--data_dir",
                        tiny_data / "clf", "--max_length", 100000, "--output_dir", tmp_path / "eval")
    assert "--max_length 100000 > the model's 512 positions (max_position_embeddings=512): cut to 512" in result.stderr
    assert json.loads((tmp_path / "eval" / "validation_results.json").read_text())["max_length"] == 512

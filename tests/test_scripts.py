"""Tests of the training/evaluation scripts (scripts/*.py) and their library side
(hf_zformer.training, hf_zformer.hub), on tiny data written into tmp folders.

Default run: single-process end-to-end runs of both scripts (with a mocked Hub push), loading the
saved folders in a clean process, evaluate_model.py, exact resume, argument errors, unit tests.
`-m slow`: 2-process CPU DDP runs under `accelerate launch --multi_gpu --num_processes 2`, and the
acceptance run on ../shared/data.
"""

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import warm_scripts
from conftest import REPO_ROOT, SHARED_DATA, run_isolated

SCRIPTS = REPO_ROOT / "scripts"
TINY_CLF = "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64"
TINY_MT = "hidden_size=32,num_hidden_layers=1,num_decoder_layers=1,num_attention_heads=2,intermediate_size=64"


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "WORLD_SIZE", "RANK", "LOCAL_RANK"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run_script(name, args, launcher=(), timeout=600, prelude=None, env=None):
    """scripts/<name> in a process of its own: under `launcher`, or forked from a warm interpreter
    (tests/warm_scripts.py: the imports paid once, not per run)."""
    script = SCRIPTS / name
    if launcher:
        result = subprocess.run([*launcher, str(script), *map(str, args)], cwd=REPO_ROOT, env={**_env(), **(env or {})},
                                capture_output=True, timeout=timeout)
    else:
        result = warm_scripts.run(script, args, REPO_ROOT, {**_env(), **(env or {})}, _env(), timeout, prelude)
    return warm_scripts.as_text(result)  # not text=True, which would turn progress-bar redraws into newlines


def run_script(name, *args, launcher=(), timeout=600, prelude=None, env=None):
    """Run scripts/<name> in a subprocess (optionally under a launcher, or after `prelude` code
    that patches things in the same process, with extra `env`); assert success; return the
    completed process."""
    result = _run_script(name, args, launcher, timeout, prelude, env)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return result


def run_script_failing(name, *args, timeout=600, env=None):
    """Run scripts/<name> like :func:`run_script` (with extra `env`) but expect it to fail."""
    result = _run_script(name, args, timeout=timeout, env=env)
    assert result.returncode != 0, f"{name} succeeded but should have failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def run_in_terminal(name, *args, timeout=600):
    """Run scripts/<name> with stdin/stdout/stderr on a pseudo-terminal (160 columns), as a user
    at a console sees it; returns the raw output (carriage returns kept)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / name), *map(str, args)], cwd=REPO_ROOT, env=_env(),
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    output = b"".join(chunks).decode("utf-8", errors="replace")
    assert proc.wait(timeout=timeout) == 0, f"{name} failed:\n{output[-8000:]}"
    return output


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """Tiny local datasets: <root>/clf/train.jsonl and <root>/mt/{train,val,test}.{de,en}."""
    root = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    words = "the a movie film plot actor scene story music ending".split()
    (root / "clf").mkdir()
    with open(root / "clf" / "train.jsonl", "w") as f:
        for i in range(120):
            label = i % 2
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 20)))
            f.write(json.dumps({"text": f"{text} {'great fun' if label else 'awful bore'}", "label": label}) + "\n")
    de = "ein mann hund katze läuft spielt auf der straße im park".split()
    en = "a man dog cat runs plays on the street in park".split()
    (root / "mt").mkdir()
    for split, n in (("train", 80), ("val", 12), ("test", 12)):
        with open(root / "mt" / f"{split}.de", "w") as fde, open(root / "mt" / f"{split}.en", "w") as fen:
            for _ in range(n):
                idx = [rng.randrange(len(de)) for _ in range(rng.randint(2, 8))]
                fde.write(" ".join(de[j] for j in idx) + "\n")
                fen.write(" ".join(en[j] for j in idx) + "\n")
    return root


PUSH_PRELUDE = """
import json, os, huggingface_hub
calls = []
def record(name):
    def fake(self, *args, **kwargs):
        calls.append({"method": name, "args": [str(a) for a in args],
                      "kwargs": {k: (v if isinstance(v, (str, int, bool, list, type(None))) else str(v)) for k, v in kwargs.items()}})
        json.dump(calls, open(os.environ["PUSH_LOG"], "w"))
        return f"https://huggingface.co/{kwargs.get('repo_id')}/commit/0"
    return fake
huggingface_hub.HfApi.create_repo = record("create_repo")
huggingface_hub.HfApi.upload_folder = record("upload_folder")
"""


@pytest.fixture(scope="module")
def clf_run(tiny_data, tmp_path_factory):
    """Single-process classification run, pushed to a mocked Hub."""
    out = tmp_path_factory.mktemp("clf") / "out"
    push_log = out.parent / "push.json"
    os.environ["PUSH_LOG"] = str(push_log)
    try:
        result = run_script(
            "run_classification.py",
            "--data_dir", tiny_data / "clf", "--attention_type", "fastformer", "--config_overrides", TINY_CLF,
            "--vocab_size", 120, "--max_length", 32, "--per_device_train_batch_size", 8, "--max_train_steps", 4,
            "--checkpointing_steps", 2, "--with_tracking", "--logging_steps", 2, "--label_names", "negative, positive",
            "--lowercase", "--truncation_side", "left", "--output_dir", out,
            "--push_to_hub", "--hub_model_id", "someone/tiny-clf", "--hub_token", "hf_fake",
            prelude=PUSH_PRELUDE,
        )
        (out.parent / "console.txt").write_text(result.stdout + result.stderr)  # captured: not a terminal
    finally:
        os.environ.pop("PUSH_LOG", None)
    return out, json.loads(push_log.read_text())


@pytest.fixture(scope="module")
def mt_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mt") / "out"
    run_script(
        "run_translation.py",
        "--data_dir", tiny_data / "mt", "--attention_type", "zformer", "--decoder_attention_type", "fastformer",
        "--config_overrides", TINY_MT, "--vocab_size", 120, "--max_target_length", 16, "--num_beams", 2,
        "--label_smoothing", 0.1, "--per_device_train_batch_size", 16, "--max_train_steps", 6, "--output_dir", out,
    )
    return out


def _card_metadata(readme: Path) -> str:
    text = readme.read_text()
    assert text.startswith("---\n")
    return text.split("---\n")[1]


# --------------------------------------------------------------------------------------------
# end to end (single process)
# --------------------------------------------------------------------------------------------


def test_classification_end_to_end(clf_run):
    out, _ = clf_run
    results = json.loads((out / "all_results.json").read_text())
    assert 0.0 <= results["eval_accuracy"] <= 1.0 and results["train_steps"] == 4
    assert results["eval_samples"] == 12  # 10% of 120 carved as validation
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] and config["architectures"] == ["ZformerForSequenceClassification"] and config["attention_type"] == "fastformer"
    assert config["hidden_size"] == 32
    for name in ("model.safetensors", "tokenizer.json", "modeling_zformer.py", "configuration_zformer.py"):
        assert (out / name).is_file(), name
    meta = _card_metadata(out / "README.md")
    for needle in ("library_name: transformers", "model-index", "type: text-classification", "type: accuracy",
                   f"value: {round(results['eval_accuracy'], 4)}", "fastformer-attention", "hf_zformer",
                   "name: someone/tiny-clf", "name: 'local data: clf'"):  # model by --hub_model_id, data: the --data_dir folder
        assert needle in meta, needle
    card = (out / "README.md").read_text()
    assert "run_classification.py" in card and "--attention_type fastformer" in card and "--lowercase" in card
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)  # --lowercase: the saved tokenizer is uncased
    assert tokenizer("GREAT Fun")["input_ids"] == tokenizer("great fun")["input_ids"]
    long_text = " ".join(["good"] * 40 + ["awful"])  # --truncation_side left: the end is kept, </s> included
    kept = tokenizer(long_text, truncation=True)["input_ids"]
    assert len(kept) == 32 and kept[-2:] == tokenizer("awful")["input_ids"][-2:]
    assert "--truncation_side left" in card
    assert "hf_fake" not in card and "--hub_token REDACTED" in card  # the token stays secret
    assert (out / "step_2" / "training_state.json").is_file() and (out / "step_4").is_dir()
    assert not list(out.glob(".hf_zformer-*-*")), "staging or backup folders left behind"
    assert list(out.rglob("events.out.tfevents*")), "--with_tracking wrote no TensorBoard events"


def test_translation_end_to_end(mt_run):
    results = json.loads((mt_run / "all_results.json").read_text())
    assert results["eval_bleu"] >= 0.0 and results["test_bleu"] >= 0.0
    assert results["eval_samples"] == 12 and results["test_samples"] == 12
    generation = json.loads((mt_run / "generation_config.json").read_text())
    assert generation["num_beams"] == 2 and generation["max_length"] == 16
    config = json.loads((mt_run / "config.json").read_text())
    assert config["decoder_attention_type"] == "fastformer" and config["label_smoothing"] == 0.1
    meta = _card_metadata(mt_run / "README.md")
    for needle in ("type: translation", "type: bleu", "split: test", "split: validation", "zformer-attention",
                   "fastformer-attention", "- de", "- en", "- name: out", "name: 'local data: mt'"):  # output folder, --data_dir
        assert needle in meta, needle
    assert "run_translation.py" in (mt_run / "README.md").read_text()


def test_log_file_gets_plain_lines_not_bar_redraws(clf_run):
    """Output captured into a file (not a terminal): no progress-bar redraws, one log line per
    --logging_steps with loss, learning rate and speed, the evaluation on lines of its own."""
    out, _ = clf_run
    with open(out.parent / "console.txt", newline="") as f:  # keep carriage returns
        console = f.read()
    assert "\r" not in console, "progress-bar redraws in a log file"
    steps = re.findall(r"step (\d+)/4: loss \d+\.\d{4}, lr \d\.\d{3}e[+-]\d+, \d+\.\d+ steps/s, elapsed \d+:\d\d:\d\d", console)
    assert steps == ["2", "4"], console
    assert "ETA" in console.split("step 2/4")[1].splitlines()[0]
    assert re.search(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO .*epoch 0 \(step 4\): \{'eval_accuracy'", console, re.M), console
    assert re.search(r"^\d{4}-.* evaluate: done 1 batches, \d+\.\d+ batches/s", console, re.M), console


def test_terminal_shows_bars_and_clean_eval_lines(tiny_data, tmp_path):
    """On a terminal: tokenizer training, training (loss and lr in the postfix) and generation show
    progress bars, and the per-epoch evaluation line starts on a cleared line, not glued to a bar."""
    output = run_in_terminal(
        "run_translation.py", "--data_dir", tiny_data / "mt", "--attention_type", "zformer", "--config_overrides",
        TINY_MT, "--vocab_size", 120, "--max_target_length", 16, "--per_device_train_batch_size", 16,
        "--max_train_steps", 6, "--logging_steps", 2, "--output_dir", tmp_path / "mt",
    )
    assert "Compute merges" in output  # the tokenizers trainer's own bar
    assert re.search(r"\rtrain:  33%.*2/6 .*loss=\d+\.\d{4}, lr=", output), output[-3000:]
    assert re.search(r"\rgenerate:   0%.* 0/1 ", output), output[-3000:]
    for epoch, step in ((0, 5), (1, 6)):
        line = next(line for line in output.split("\n") if f"epoch {epoch} (step {step})" in line)
        assert re.match(r"\d{4}-\d\d-\d\d ", line.rstrip("\r").split("\r")[-1]), repr(line)  # after the last redraw


def test_push_to_hub_mocked(clf_run):
    out, calls = clf_run
    # create_repo at the start (access check before training), then the push
    assert [c["method"] for c in calls] == ["create_repo", "create_repo", "upload_folder"]
    assert calls[0]["kwargs"]["repo_id"] == "someone/tiny-clf" and calls[0]["kwargs"]["exist_ok"] is True
    upload = calls[2]["kwargs"]
    assert upload["repo_id"] == "someone/tiny-clf" and Path(upload["folder_path"]) == out
    assert any(p.startswith("step_") for p in upload["ignore_patterns"])  # checkpoints stay local


def test_push_to_hub_offline_fails_before_training(tiny_data, tmp_path):
    """--push_to_hub without network: a one-paragraph error at the start, nothing trained."""
    out = tmp_path / "out"
    result = run_script_failing(
        "run_classification.py", "--data_dir", tiny_data / "clf", "--attention_type", "fastformer",
        "--config_overrides", TINY_CLF, "--vocab_size", 120, "--max_train_steps", 2, "--output_dir", out,
        "--push_to_hub", "--hub_model_id", "someone/tiny-clf", "--hub_token", "hf_fake",
    )  # _env() sets HF_HUB_OFFLINE=1
    assert "cannot create or write the Hub repository 'someone/tiny-clf'" in result.stderr
    assert "Traceback" not in result.stderr and "hf_fake" not in result.stderr
    assert not (out / "model.safetensors").exists() and not (out / "tokenizer.json").exists()


def test_check_push_access_message(monkeypatch):
    import huggingface_hub

    from hf_zformer import hub

    def refuse(self, **kwargs):
        raise ConnectionError("Cannot reach https://huggingface.co/api/repos/create: no network\n(details)")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refuse)
    with pytest.raises(RuntimeError, match=r"'me/model' \(ConnectionError: Cannot reach .*: no network\).*--hub_token") as error:
        hub.check_push_access("me/model", token="hf_x")
    assert "\n" not in str(error.value)


def test_with_tracking_needs_an_installed_tracker(tiny_data, tmp_path, capsys, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "_available_trackers", [])  # tensorboard not installed
    argv = ["--data_dir", str(tiny_data / "clf"), "--attention_type", "full", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as error:
        load_script("run_classification.py").parse_args([*argv, "--with_tracking"])
    assert error.value.code == 2 and "pip install tensorboard" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_script("run_translation.py").parse_args([*argv, "--with_tracking", "--report_to", "no_such_tracker"])
    assert "'no_such_tracker' is not a tracker" in capsys.readouterr().err
    load_script("run_classification.py").parse_args(argv)  # without --with_tracking nothing is needed


def test_output_dir_lock(tiny_data, tmp_path):
    """A second run on a folder in use fails at once, naming the folder and the other run's pid."""
    import fcntl

    from hf_zformer import folders

    out = tmp_path / "out"
    out.mkdir()
    folders.record(out)  # the other run marked its new folder as the library's before locking it
    with open(out / ".lock", "w") as held:  # this test process plays the other run
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write(f"{os.getpid()}\n")
        held.flush()
        result = run_script_failing("run_classification.py", "--data_dir", tiny_data / "clf", "--attention_type",
                                    "fastformer", "--config_overrides", TINY_CLF, "--vocab_size", 120,
                                    "--max_train_steps", 2, "--output_dir", out)
    assert f"pid {os.getpid()}" in result.stderr and str(out) in result.stderr and "in use by another run" in result.stderr
    assert "Traceback" not in result.stderr and not (out / "tokenizer.json").exists()


def test_bad_labels_fail_before_training(tmp_path):
    """A -1 label (crashed at step 21 with IndexError) and, with --num_labels 2, a label 7 (built
    an 8-class model) end the script before training with a message naming file and line."""
    data = tmp_path / "data"
    data.mkdir()
    common = ["--data_dir", data, "--attention_type", "fastformer", "--config_overrides", TINY_CLF,
              "--vocab_size", 120, "--max_length", 32, "--max_train_steps", 30, "--per_device_train_batch_size", 2]
    for bad, extra in ((-1, []), (7, ["--num_labels", 2])):
        rows = [{"text": f"text {i}", "label": i % 2} for i in range(60)]
        rows[41]["label"] = bad
        (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / f"out{bad}"
        result = run_script_failing("run_classification.py", *common, *extra, "--output_dir", out)
        assert f"train.jsonl line 42: label column 'label' has the value {bad}; class ids must be" in result.stderr
        assert "Traceback" not in result.stderr and not (out / "tokenizer.json").exists()


def test_checkpoint_disk_full_message(tmp_path):
    import errno

    from hf_zformer.training import checkpoints

    class FullDisk:
        is_main_process = True

        def wait_for_everyone(self):
            pass

        def save_state(self, folder):
            Path(folder).mkdir(exist_ok=True)  # the marked staging folder save_checkpoint made
            (Path(folder) / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="disk is full") as error:
        checkpoints.save_checkpoint(FullDisk(), tmp_path, "step_2", {"completed_steps": 2})
    assert error.value.errno == errno.ENOSPC and str(tmp_path) in str(error.value)
    assert not list(tmp_path.glob(".hf_zformer-*"))  # the partial save is removed (frees the space)


def test_push_to_hub_function(tmp_path, monkeypatch):
    import huggingface_hub

    from hf_zformer import hub

    seen = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, **kw: seen.append(("create", kw, self.token)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **kw: seen.append(("upload", kw)) or "url")
    assert hub.push_to_hub(tmp_path, "me/model", token="hf_x") == "url"
    assert seen[0][0] == "create" and seen[0][1]["repo_id"] == "me/model" and seen[0][2] == "hf_x"
    assert seen[1][1]["folder_path"] == str(tmp_path)


def test_saved_models_load_in_clean_process(clf_run, mt_run, tmp_path):
    clf_out, _ = clf_run
    result = run_isolated(
        f"""
        import torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
        model = AutoModelForSeq2SeqLM.from_pretrained({str(mt_run)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        tokenizer = AutoTokenizer.from_pretrained({str(mt_run)!r})
        batch = tokenizer(["ein mann im park", "ein hund"], return_tensors="pt", padding=True)
        out = model.generate(**batch)
        assert out.shape[0] == 2 and out.shape[1] <= 16, out.shape   # generation_config max_length
        print("translation:", tokenizer.batch_decode(out, skip_special_tokens=True))
        classify = pipeline("text-classification", model={str(clf_out)!r}, trust_remote_code=True)
        predictions = classify(["the movie was great fun", "awful bore"])
        assert all(p["label"] in ("negative", "positive") for p in predictions), predictions  # --label_names
        print("classification:", predictions)
        """,
        cwd=tmp_path,
    )
    assert "classification:" in result.stdout


def test_saved_tokenizer_loads_without_remote_code_prompt(clf_run, tmp_path):
    """AutoTokenizer.from_pretrained(folder) asks nothing where hf_zformer is imported (the model
    type is registered), and nothing where it is absent when trust_remote_code=True is passed, as
    the card's snippet does. (Without either, transformers' AutoTokenizer reads config.json's
    auto_map.AutoConfig before the tokenizer files and asks whether to run the model code: no file
    in the folder can avoid that while the models still load with trust_remote_code.)"""
    clf_out, _ = clf_run

    def code(load: str) -> str:
        return "\n".join([
            "import builtins",
            "asked = []",
            "builtins.input = lambda prompt='': asked.append(prompt) or 'n'  # a user answering no",
            "from transformers import AutoTokenizer",
            load,
            "assert tokenizer('great fun').input_ids[-1] == tokenizer.eos_token_id",
            "print('prompted:', bool(asked))",
        ])

    imported = warm_scripts.run_code(
        code(f"import hf_zformer; tokenizer = AutoTokenizer.from_pretrained({str(clf_out)!r})"), cwd=REPO_ROOT, env=_env()
    )
    assert "prompted: False" in imported.stdout, imported.stdout + imported.stderr
    isolated = run_isolated(
        code(f"tokenizer = AutoTokenizer.from_pretrained({str(clf_out)!r}, trust_remote_code=True)"), cwd=tmp_path
    )
    assert "prompted: False" in isolated.stdout, isolated.stdout + isolated.stderr


def test_saved_tokenizer_config_is_plain(clf_run):
    """The saved tokenizer needs no custom code: a class built into transformers, no auto_map."""
    clf_out, _ = clf_run
    tokenizer_config = json.loads((clf_out / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "TokenizersBackend" and "auto_map" not in tokenizer_config


def _python_block(readme: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


def test_model_card_usage_runs_as_written(clf_run, mt_run, tmp_path):
    """The cards' Python snippets run unchanged in a clean process (no hf_zformer); the classifier's
    loads the --hub_model_id, pointed here at the local folder; the translator's loads --output_dir."""
    clf_out, _ = clf_run
    clf_code = _python_block(clf_out / "README.md")
    assert "model_id = 'someone/tiny-clf'" in clf_code and "pipeline('text-classification'" in clf_code
    clf_code = clf_code.replace("'someone/tiny-clf'", repr(str(clf_out)))
    mt_code = _python_block(mt_run / "README.md")
    assert f"model_id = {str(mt_run)!r}" in mt_code and ".generate(" in mt_code and "trust_remote_code=True" in mt_code
    result = run_isolated(clf_code + "\n" + mt_code, cwd=tmp_path)
    classified, translated = result.stdout.strip().splitlines()[-2:]
    assert re.fullmatch(r"\[\{'label': '(negative|positive)', 'score': [\d.e-]+\}\]", classified), classified
    assert translated and "<" not in translated, translated  # decoded text, special tokens skipped


def test_model_card_license_datasets_and_labels(clf_run):
    out, _ = clf_run
    meta = _card_metadata(out / "README.md")
    assert "license: apache-2.0" in meta  # hf_zformer's license (setup.cfg): the card ships its code
    assert "datasets:" not in meta  # --data_dir: no Hub dataset id to link
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"} and config["label2id"] == {"negative": 0, "positive": 1}


def test_model_card_names_local_data_as_local(clf_run):
    """A --data_dir run's card says the data was a local folder, in its text and in model-index,
    instead of naming a Hub dataset that happens to share the folder's name."""
    out, _ = clf_run
    card = (out / "README.md").read_text()
    meta = _card_metadata(out / "README.md")
    assert "on the local data `clf`" in card and "the Hub dataset" not in card
    assert "type: local" in meta and "name: 'local data: clf'" in meta, meta


def test_first_run_is_quiet_and_says_what_it_does(tiny_data, tmp_path):
    """One process, defaults: no warning about a default, no accelerate environment dump or rank
    prefix; a line for each long phase (reading the data, training the tokenizer, scoring the test
    split); the last line names the folder written, and no lock file stays in it."""
    data = tmp_path / "data"
    data.mkdir()
    lines = (tiny_data / "clf" / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines[20:]) + "\n")
    (data / "test.jsonl").write_text("\n".join(lines[:20]) + "\n")
    common = ["--data_dir", data, "--attention_type", "fastformer", "--config_overrides", TINY_CLF,
              "--vocab_size", 120, "--max_length", 32, "--per_device_train_batch_size", 8]
    out = tmp_path / "out"
    result = run_script("run_classification.py", *common, "--max_train_steps", 2, "--output_dir", out)
    console = result.stdout + result.stderr
    for quiet in ("does nothing in", "[RANK", "Distributed environment", "Warning", "warn"):
        assert quiet not in console, f"{quiet!r} in a default run:\n{console}"
    for phase in (f"reading {data}", "read 90 train, 10 validation, 20 test texts", "training a 120-token tokenizer",
                  "scoring the final model on the 20 texts of the test split"):
        assert phase in console, f"no {phase!r} line:\n{console}"
    assert console.strip().splitlines()[-1].endswith(f"saved the model, tokenizer, results and model card to {out}")
    assert not (out / ".lock").exists() and "test_accuracy" in json.loads((out / "all_results.json").read_text())
    skipped = tmp_path / "skipped"
    run_script("run_classification.py", *common, "--max_train_steps", 1, "--skip_test", "--output_dir", skipped)
    assert "test_accuracy" not in json.loads((skipped / "all_results.json").read_text())


def test_label_names_default_to_class_label_names():
    import logging
    from types import SimpleNamespace

    import datasets

    def mapping(train, label_names=None, num_labels=None):
        args = SimpleNamespace(label_names=label_names, num_labels=num_labels)
        raw = datasets.DatasetDict({"train": train})
        return load_script("run_classification.py").label_mapping(args, raw, ("train",), "data", logging.getLogger())

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    train = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 0]}, features=features)
    assert mapping(train) == (2, {0: "neg", 1: "pos"})  # Hub IMDB's names; 2 classes though one is seen
    assert mapping(train, ["negative", "positive"], 2) == (2, {0: "negative", 1: "positive"})  # --label_names wins
    plain = datasets.Dataset.from_dict({"text": ["a", "b", "c"], "label": [0, 2, 1]})
    assert mapping(plain) == (3, None)
    with pytest.raises(ValueError, match="give one name per class"):
        mapping(plain, num_labels=3, label_names=["negative", "positive"])
    with pytest.raises(ValueError, match="give one name per class"):
        mapping(train, num_labels=3)


def test_evaluate_model_script_translation(mt_run, tiny_data, tmp_path):
    result = run_script("evaluate_model.py", "--model_name_or_path", mt_run, "--data_dir", tiny_data / "mt",
                        "--output_dir", tmp_path / "mt", "--length_buckets", 4, 1000)
    assert re.search(r"generate: done 1 batches, \d+\.\d+ batches/s", result.stderr), result.stderr  # not silent
    metrics = json.loads((tmp_path / "mt" / "test_results.json").read_text())
    trained = json.loads((mt_run / "all_results.json").read_text())
    assert metrics["task"] == "translation" and metrics["num_beams"] == 2  # from the saved generation config
    assert metrics["test_bleu"] == pytest.approx(trained["test_bleu"])  # same model, data and decoding
    rows = [json.loads(line) for line in (tmp_path / "mt" / "test_predictions.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(12)) and {"source", "prediction", "reference"} <= set(rows[0])
    short, rest, empty = metrics["test_by_length"]  # by source words: 1-4, 5-1000, >=1001
    assert short["words"] == "1-4" and empty == {"words": ">=1001", "samples": 0, "bleu": None, "bleu_lowercase": None}
    assert short["samples"] == sum(len(r["source"].split()) <= 4 for r in rows) and short["samples"] + rest["samples"] == 12
    if short["samples"] == 0:  # then the second bucket holds every sentence: the overall score
        assert rest["bleu"] == pytest.approx(metrics["test_bleu"])
    assert "| 1-4 |" in result.stderr


@pytest.mark.slow  # the classification branch is the simpler one; keeps the default run short
def test_evaluate_model_script_classification(clf_run, tiny_data, tmp_path):
    clf_out, _ = clf_run
    run_script("evaluate_model.py", "--model_name_or_path", clf_out, "--data_dir", tiny_data / "clf",
               "--split", "validation", "--output_dir", tmp_path / "clf")
    metrics = json.loads((tmp_path / "clf" / "validation_results.json").read_text())
    trained = json.loads((clf_out / "all_results.json").read_text())
    assert metrics["validation_accuracy"] == pytest.approx(trained["eval_accuracy"])
    rows = (tmp_path / "clf" / "validation_predictions.jsonl").read_text().splitlines()
    assert len(rows) == 12
    assert metrics["truncation_side"] == "left"  # the trained tokenizer's (--truncation_side left)
    run_script("evaluate_model.py", "--model_name_or_path", clf_out, "--data_dir", tiny_data / "clf",
               "--split", "validation", "--truncation_side", "right", "--max_length", 3, "--output_dir", tmp_path / "cut")
    cut = json.loads((tmp_path / "cut" / "validation_results.json").read_text())
    assert cut["truncation_side"] == "right" and cut["max_length"] == 3 and cut["validation_samples"] == 12


def test_evaluate_model_max_eval_samples_is_training_subset(clf_run, tmp_path):
    """--max_eval_samples takes training's seeded subset, not the first N rows (a validation file
    sorted by label would otherwise give one class only)."""
    from hf_zformer.training import run
    from hf_zformer.data import load_classification_dataset

    clf_out, _ = clf_run
    data = tmp_path / "sorted"
    data.mkdir()
    for split, n in (("train", 8), ("validation", 40)):
        with open(data / f"{split}.jsonl", "w") as f:
            for i in range(n):
                label = int(i >= n // 2)  # sorted by label, like IMDB
                f.write(json.dumps({"text": "great fun" if label else "awful bore", "label": label}) + "\n")
    run_script("evaluate_model.py", "--model_name_or_path", clf_out, "--data_dir", data, "--split", "validation",
               "--max_eval_samples", 10, "--split_seed", 3, "--seed", 5, "--output_dir", tmp_path / "eval")
    rows = [json.loads(line) for line in (tmp_path / "eval" / "validation_predictions.jsonl").read_text().splitlines()]
    raw = load_classification_dataset(data, seed=3)
    # what run_classification.py --max_eval_samples 10 --split_seed 3 keeps, whatever its --seed
    run.subsample(raw, {"validation": 10}, 3)
    assert [r["label"] for r in rows] == raw["validation"]["label"]
    assert {r["label"] for r in rows} == {0, 1}


def test_evaluate_model_needs_trust_remote_code_for_foreign_code(clf_run, tiny_data, tmp_path):
    """A folder whose config.json auto_map points at its own code: that code does not run without
    --trust_remote_code (clear error); hf_zformer's own checkpoints need no flag (clf_run has an auto_map)."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({
        "model_type": "not_hf_zformer",
        "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                     "AutoModelForSequenceClassification": "configuration_evil.EvilModel"},
    }))
    marker = tmp_path / "remote_code_ran"
    (foreign / "configuration_evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PretrainedConfig\nclass EvilConfig(PretrainedConfig):\n    model_type = 'not_hf_zformer'\n"
    )
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = run_script_failing("evaluate_model.py", "--model_name_or_path", foreign, "--data_dir", tiny_data / "clf",
                                "--output_dir", tmp_path / "eval", env=env)
    assert not marker.exists(), "the checkpoint's code ran without --trust_remote_code"
    assert "--trust_remote_code" in result.stderr and str(foreign) in result.stderr
    assert "Traceback" not in result.stderr
    clf_out, _ = clf_run
    run_script("evaluate_model.py", "--model_name_or_path", clf_out, "--data_dir", tiny_data / "clf",
               "--max_eval_samples", 4, "--output_dir", tmp_path / "own")
    assert json.loads((tmp_path / "own" / "validation_results.json").read_text())["validation_samples"] == 4


def _strict_json(path: Path):
    """Parse ``path`` rejecting NaN/Infinity (not JSON; other parsers refuse them)."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_resume_matches_uninterrupted_run(tiny_data, tmp_path):
    """A run resumed from a mid-epoch checkpoint (model, optimizer, scheduler, RNG, step counter,
    dataloader position) ends with exactly the weights of the uninterrupted run (dropout on,
    across an epoch boundary: 108 examples / 16 = 7 batches per epoch, 10 steps), and reports the
    same whole-run train_loss and the accumulated runtime; resuming the finished run (from its
    last checkpoint, into the same folder) keeps those statistics in a strict-JSON all_results.json."""
    from safetensors.torch import load_file

    common = ["--data_dir", tiny_data / "clf", "--attention_type", "zformer", "--config_overrides", TINY_CLF,
              "--vocab_size", 120, "--max_length", 32, "--per_device_train_batch_size", 16, "--max_train_steps", 10,
              "--gradient_accumulation_steps", 1]
    run_script("run_classification.py", *common, "--checkpointing_steps", 5, "--output_dir", tmp_path / "a")
    state = json.loads((tmp_path / "a" / "step_5" / "training_state.json").read_text())
    assert {k: state[k] for k in ("completed_steps", "epoch", "batches_done")} == {"completed_steps": 5, "epoch": 0,
                                                                                 "batches_done": 5}
    run_script("run_classification.py", *common, "--resume_from_checkpoint", tmp_path / "a" / "step_5",
               "--output_dir", tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] == b[key]).all(), f"{key} differs after resume"
    results_a = _strict_json(tmp_path / "a" / "all_results.json")
    results_b = _strict_json(tmp_path / "b" / "all_results.json")
    assert results_a["eval_accuracy"] == results_b["eval_accuracy"] and results_b["train_steps"] == 10
    assert results_b["train_loss"] == pytest.approx(results_a["train_loss"], rel=1e-6)  # the whole run, not a window
    assert state["loss_count"] == 5 and results_b["train_runtime_s"] >= round(state["train_runtime_s"], 1)  # both segments

    # resume the finished run: nothing left to train, the statistics come from the last checkpoint
    final_state = json.loads((tmp_path / "a" / "step_10" / "training_state.json").read_text())
    run_script("run_classification.py", *common, "--resume_from_checkpoint", "latest", "--output_dir", tmp_path / "a")
    results_c = _strict_json(tmp_path / "a" / "all_results.json")
    assert results_c["train_loss"] == pytest.approx(results_a["train_loss"], rel=1e-6)
    assert results_c["train_runtime_s"] == pytest.approx(final_state["train_runtime_s"], abs=0.2)
    # not the near-zero resumed segment (runtimes are rounded to 0.1 s: allow one rounding step)
    assert results_c["train_runtime_s"] >= 0.5 * results_a["train_runtime_s"] - 0.1
    assert results_c["eval_accuracy"] == results_a["eval_accuracy"] and results_c["train_steps"] == 10
    assert results_a["epoch"] == results_b["epoch"] == results_c["epoch"] == round(10 / 7, 2)  # epochs trained
    card = (tmp_path / "a" / "README.md").read_text()
    assert f"| train_loss | {results_a['train_loss']} |" in card and "nan" not in card.lower()


# --------------------------------------------------------------------------------------------
# argument errors (in-process: parse_args only, nothing trains)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "script, extra, message",
    [
        ("run_classification.py", ["--dataset_name", "stanfordnlp/imdb", "--data_dir", "{clf}"], "exclusive"),
        ("run_classification.py", [], "no data"),
        ("run_classification.py", ["--data_dir", "{missing}"], "is not a directory"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "softmax"], "invalid choice: 'softmax'"),
        ("run_classification.py", ["--data_dir", "{clf}"], "--attention_type"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--config_overrides", "hidden_sise=64"],
         "unknown config field 'hidden_sise'"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--config_overrides", "hidden_size=big"],
         "expected a int"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--config_overrides",
                                   "hidden_size=30,num_attention_heads=4"], "not divisible by num_attention_heads=4"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--push_to_hub"], "--hub_model_id"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--checkpointing_steps", "often"],
         "--checkpointing_steps"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--resume_from_checkpoint", "{missing}"],
         "is not a checkpoint folder"),
        ("run_classification.py", ["--data_dir", "{clf}", "--model_name_or_path", "x", "--attention_type", "full"],
         "drop one side"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--label_names", "neg,,pos"],
         "--label_names must be distinct non-empty names"),
        ("run_translation.py", ["--data_dir", "{mt}", "--attention_type", "full", "--decoder_attention_type", "xformer"],
         "invalid choice: 'xformer'"),
        ("run_translation.py", ["--data_dir", "{mt}", "--attention_type", "full", "--label_smoothing", "1.5"],
         "--label_smoothing"),
        ("run_translation.py", ["--data_dir", "{mt}", "--attention_type", "full", "--source_lang", "en"], "both 'en'"),
        ("evaluate_model.py", ["--model_name_or_path", "x"], "exactly one of --dataset_name"),
        ("run_classification.py", ["--data_dir", "{clf}", "--attention_type", "full", "--tokenizer_name", "tok",
                                   "--lowercase"], "--tokenizer_name 'tok' brings its own tokenizer"),
    ],
)
def test_bad_arguments_fail_before_training(script, extra, message, tiny_data, tmp_path, capsys):
    paths = {"clf": tiny_data / "clf", "mt": tiny_data / "mt", "missing": tmp_path / "nope"}
    argv = [a.format(**paths) for a in extra] + ["--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as error:
        load_script(script).parse_args(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# library units
# --------------------------------------------------------------------------------------------


def test_results_never_nan_nor_replaced_by_empty(tmp_path):
    """all_results.json stays strict JSON; a value a run could not measure keeps the earlier number."""
    import logging

    from hf_zformer.training import run

    path = tmp_path / "all_results.json"
    path.write_text(json.dumps({"train_loss": 0.5, "eval_accuracy": 0.7}))
    written = run.results_to_write({"train_loss": float("nan"), "eval_accuracy": 0.8, "epoch": 1}, path,
                                         logging.getLogger("test"))
    assert written == {"train_loss": 0.5, "eval_accuracy": 0.8, "epoch": 1}
    path.unlink()
    written = run.results_to_write({"train_loss": float("inf")}, path, logging.getLogger("test"))
    assert json.dumps(written, allow_nan=False) == '{"train_loss": null}'


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("script", ["run_classification.py", "run_translation.py", "evaluate_model.py",
                                    "benchmark_attention.py", "benchmark_generation.py"])
def test_parsers_refuse_abbreviations(script, monkeypatch):
    """No parser in scripts/ accepts abbreviated options (``--hub_tok X`` was taken as --hub_token)."""
    import argparse

    seen = []

    def record(self, *args, **kwargs):
        seen.append(self.allow_abbrev)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    with pytest.raises(_Parsed):
        load_script(script).parse_args([])
    assert seen == [False]


def test_hub_token_abbreviation_rejected_and_redacted(tiny_data, tmp_path, capsys, monkeypatch):
    from hf_zformer.training import run

    argv = ["--data_dir", str(tiny_data / "clf"), "--attention_type", "full", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as error:
        load_script("run_classification.py").parse_args([*argv, "--hub_tok", "hf_secret"])
    assert error.value.code == 2 and "unrecognized arguments: --hub_tok hf_secret" in capsys.readouterr().err
    # the recorded command redacts the parsed token value wherever it appears
    monkeypatch.setattr(sys, "argv", ["scripts/run_classification.py", "--hub_to", "hf_secret", "--token=hf_secret",
                                      "--hub_token", "hf_secret", "--seed", "1"])
    command = run.command_line("hf_secret")
    assert "hf_secret" not in command and "--hub_to REDACTED" in command and "--token=REDACTED" in command
    assert "--seed 1" in command


def test_config_overrides_are_typed_by_field():
    from hf_zformer.training.arguments import parse_config_overrides

    parsed = parse_config_overrides(
        "hidden_size=64, classifier_dropout=0.2,scale_embedding=false,attention_type=fastformer|full,"
        "position_embedding_type=learned,zformer_scale_init=10,classifier_dropout=none"
    )
    assert parsed == {"hidden_size": 64, "classifier_dropout": None, "scale_embedding": False,
                      "attention_type": ["fastformer", "full"], "position_embedding_type": "learned",
                      "zformer_scale_init": 10.0}
    assert isinstance(parsed["zformer_scale_init"], float)
    # "none" is a value of a string field, not a missing one
    assert parse_config_overrides("hidden_act=none") == {"hidden_act": "none"}
    assert parse_config_overrides(None) == {} and parse_config_overrides("") == {}
    with pytest.raises(ValueError, match="key=value"):
        parse_config_overrides("hidden_size")
    with pytest.raises(ValueError, match="expected a bool"):
        parse_config_overrides("scale_embedding=maybe")


def test_length_grouped_batches():
    from hf_zformer.training.batching import LengthGroupedBatchSampler, pad_collate

    rng = random.Random(0)
    lengths = [rng.randint(1, 200) for _ in range(1000)]
    sampler = LengthGroupedBatchSampler(lengths, 16, seed=3, bucket_batches=8)
    epoch0 = list(sampler)
    assert sorted(i for b in epoch0 for i in b) == list(range(1000)) and len(epoch0) == len(sampler) == 63
    assert list(sampler) == epoch0  # a pure function of (seed, epoch)
    sampler.use_epoch(1)
    assert list(sampler) != epoch0
    padded = sum(len(b) * max(lengths[i] for i in b) for b in epoch0)
    random_padded = sum(16 * max(lengths[i : i + 16]) for i in range(0, 1000, 16))
    assert padded < 0.75 * random_padded and padded < 1.15 * sum(lengths)
    ordered = list(LengthGroupedBatchSampler(lengths, 16, shuffle=False))
    assert [lengths[i] for b in ordered for i in b] == sorted(lengths, reverse=True)

    batch = pad_collate(0)([{"input_ids": [5, 6, 2], "attention_mask": [1, 1, 1], "labels": [7, 2], "index": 0},
                            {"input_ids": [5, 2], "attention_mask": [1, 1], "labels": [7, 8, 9, 2], "index": 1}])
    assert batch["input_ids"].tolist() == [[5, 6, 2], [5, 2, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[7, 2, -100, -100], [7, 8, 9, 2]] and batch["index"].tolist() == [0, 1]


def test_model_card_metadata():
    from huggingface_hub import ModelCard

    from conftest import tiny_config
    from hf_zformer.hub import model_card

    config = tiny_config(attention_type="zformer", decoder_attention_type="fastformer", num_decoder_layers=1,
                         is_encoder_decoder=True)
    text = model_card(config=config, results={"eval_bleu": 12.34567, "test_bleu": 11.0}, task="translation",
                      dataset_name="bentrevett/multi30k", metric_name="bleu", command="python x.py --a 1",
                      model_name="me/mt", languages=["de", "en"])
    card = ModelCard(text)
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "translation"
    assert {"hf_zformer", "zformer-attention", "fastformer-attention", "translation"} <= set(data.tags)
    values = {r.dataset_split: r.metric_value for r in data.eval_results}
    assert values == {"test": 11.0, "validation": 12.3457}
    assert all(r.task_type == "translation" and r.metric_type == "bleu" for r in data.eval_results)
    assert "python x.py --a 1" in text and "trust_remote_code=True" in text
    assert data.license == "apache-2.0" and data.datasets == ["bentrevett/multi30k"]  # a Hub dataset id is linked
    assert "model_id = 'me/mt'" in text and "Ein Mann" in text and ".generate(**inputs)" in text
    local = ModelCard(model_card(config=config, results={}, task="translation", dataset_name="multi30k",
                                 metric_name="bleu", command="python x.py", hub_dataset=False, model_id="runs/mt"))
    assert local.data.datasets is None and "model_id = 'runs/mt'" in local.text


# --------------------------------------------------------------------------------------------
# multi-process (slow)
# --------------------------------------------------------------------------------------------

# port 0: accelerate picks a free port, so DDP runs in parallel test workers do not collide on 29500
DDP = ("accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0")


@pytest.mark.slow
def test_ddp_two_cpu_processes(tiny_data, tmp_path):
    run_script("run_classification.py", "--data_dir", tiny_data / "clf", "--attention_type", "fastformer",
               "--config_overrides", TINY_CLF, "--vocab_size", 120, "--per_device_train_batch_size", 8,
               "--max_train_steps", 4, "--checkpointing_steps", 2, "--output_dir", tmp_path / "clf", launcher=DDP)
    run_script("run_translation.py", "--data_dir", tiny_data / "mt", "--attention_type", "zformer",
               "--config_overrides", TINY_MT, "--vocab_size", 120, "--max_target_length", 16,
               "--per_device_train_batch_size", 8, "--max_train_steps", 4, "--output_dir", tmp_path / "mt", launcher=DDP)
    clf = json.loads((tmp_path / "clf" / "all_results.json").read_text())
    mt = json.loads((tmp_path / "mt" / "all_results.json").read_text())
    assert clf["num_processes"] == 2 and mt["num_processes"] == 2  # real DDP, not two independent jobs
    assert clf["eval_samples"] == 12 and mt["eval_samples"] == 12  # gather_for_metrics drops duplicates
    assert "eval_bleu" in mt and "eval_accuracy" in clf
    assert sorted(p.name for p in (tmp_path / "clf" / "step_2").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"]
    for out in ("clf", "mt"):
        assert "accelerate launch --multi_gpu --num_processes 2" in (tmp_path / out / "README.md").read_text()
    run_isolated(
        f"""
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
        model = AutoModelForSeq2SeqLM.from_pretrained({str(tmp_path / 'mt')!r}, trust_remote_code=True)
        tokenizer = AutoTokenizer.from_pretrained({str(tmp_path / 'mt')!r})
        model.generate(**tokenizer(["ein hund"], return_tensors="pt"))
        pipeline("text-classification", model={str(tmp_path / 'clf')!r}, trust_remote_code=True)("great fun")
        """,
        cwd=tmp_path,
    )


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "imdb").is_dir(), reason="shared data not present")
def test_acceptance_on_shared_data(tmp_path):
    run_script("run_classification.py", "--data_dir", SHARED_DATA / "imdb", "--attention_type", "fastformer",
               "--max_train_samples", 256, "--max_eval_samples", 128, "--max_train_steps", 12, "--config_overrides",
               "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128",
               "--output_dir", tmp_path / "clf", launcher=DDP)
    run_script("run_translation.py", "--data_dir", SHARED_DATA / "multi30k", "--attention_type", "zformer",
               "--max_train_samples", 256, "--max_eval_samples", 128, "--max_train_steps", 12, "--config_overrides",
               "hidden_size=64,num_hidden_layers=2,num_attention_heads=4,intermediate_size=128",
               "--output_dir", tmp_path / "mt", launcher=DDP)
    assert "eval_accuracy" in json.loads((tmp_path / "clf" / "all_results.json").read_text())
    assert "eval_bleu" in json.loads((tmp_path / "mt" / "all_results.json").read_text())


def test_gpu_prepare_writes_only_git_ignored_folders():
    """gpu_prepare.sh fills .whl/ (wheels, ~16 MB) and gpu_data/ (the datasets' files) in the checkout, as
    its header says git-ignored: `git add -A` after preparing a GPU run must not take them."""
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    script = (SCRIPTS / "gpu_prepare.sh").read_text()
    folders = {path.split("/")[0] for path in re.findall(r"^mkdir -p (.+)$", script, re.M) for path in path.split()}
    assert folders == {".whl", "gpu_data"}, folders
    for folder in folders:
        probe = f"{folder}/probe.whl"
        check = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO_ROOT)
        assert check.returncode == 0, f"{probe} is not git-ignored"


@pytest.mark.slow
def test_gpu_check_dry_run_on_a_cpu(tmp_path):
    """`scripts/gpu_check.sh` with QUICK=1 (toy sizes, the kernels through triton's interpreter): its
    measuring steps finish, each records its exit status, and the archive it rewrites after every
    step holds their reports, with the folded-form column the bf16 grid needs."""
    import tarfile

    steps = ["environment", "grid_graphs", "grid_module", "ab_fastformer", "profile", "grid_bf16", "grid_fp32", "compile_tests",
             "grid_compiled", "kernel_resources"]
    archive = tmp_path / "check.tar.gz"
    env = dict(os.environ, QUICK="1", STEPS=" ".join(steps), PYTHON=sys.executable, ARCHIVE=str(archive))
    subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "check")], env=env, check=True,
                   cwd=REPO_ROOT, capture_output=True, timeout=900)
    # the step records (a note such as "training steps skipped: no gpu_data/" may stand between them)
    summary = [line for line in (tmp_path / "check" / "summary.txt").read_text().splitlines() if " rc=" in line]
    assert [line.split()[0] for line in summary] == steps
    assert all(line.split()[1] == "rc=0" for line in summary), summary
    with tarfile.open(archive) as packed:
        names = {Path(name).name for name in packed.getnames()}
        grid = json.load(packed.extractfile("check/attention_grid_bf16_graphs.json"))
        modules = json.load(packed.extractfile("check/module_grid_bf16_graphs.json"))
        report = json.load(packed.extractfile("check/acceptance.json"))
    assert {"summary.txt", "attention_grid_bf16_graphs.md", "profile_bf16.md", "ab_fastformer.log",
            "attention_grid_bf16_compiled.md", "kernel_resources.json", "acceptance.md"} <= names
    # the toy grids are not the acceptance shape: no bar measured; on a CPU the default forms fold
    # under autocast too, so no folded form differs from its default form
    assert all(b["speedup"] is None for found in report["bars"].values() for b in found)
    assert report["folded"]["verdicts"] == {"zformer": "not measured", "fastformer": "not measured"}
    assert {"zformer_folded", "fastformer_folded"} <= {row["attention_type"] for row in grid["results"]}
    assert all(row["status"] == "ok" for row in grid["results"] + modules["results"])
    assert {row["level"] for row in modules["results"]} == {"module"}


def _gpu_check_within(budget, tmp_path):
    """The GPU check (QUICK=1, on this CPU) under BUDGET=`budget`: (seconds it took, its step records)."""
    import time

    env = dict(os.environ, QUICK="1", BUDGET=str(budget), PYTHON=sys.executable, ARCHIVE=str(tmp_path / "check.tar.gz"))
    start = time.monotonic()
    subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path / "check")], env=env, check=True,
                   cwd=REPO_ROOT, capture_output=True, timeout=budget + 120)
    lines = (tmp_path / "check" / "summary.txt").read_text().splitlines()
    return time.monotonic() - start, [line for line in lines if " rc=" in line or " not run: " in line]


def test_gpu_check_with_its_budget_spent_names_every_step_it_did_not_run(tmp_path):
    """Too little budget to start a step: each is listed as not run, in the order it would have run
    (the acceptance grids first, then the kernel tests), and the archive still holds the summary."""
    import tarfile

    seconds, records = _gpu_check_within(25, tmp_path)
    assert all(line.endswith("not run: the budget (BUDGET=25s) is spent") for line in records), records
    assert [line.split()[0] for line in records[:4]] == ["environment", "grid_graphs", "grid_module", "kernel_tests"]
    assert {"kernel_tests", "device_tests", "grid_compiled", "kernel_resources"} <= {line.split()[0] for line in records}
    with tarfile.open(tmp_path / "check.tar.gz") as packed:
        assert "check/summary.txt" in packed.getnames()
        # the report of what ran against the bars, written before every archive: nothing ran yet
        assert "Not run." in packed.extractfile("check/acceptance.md").read().decode()


@pytest.mark.slow
def test_gpu_check_ends_within_its_budget(tmp_path):
    """A step gets at most what is left of BUDGET and is stopped there; the steps after it are not
    run: the whole check ends within its budget."""
    seconds, records = _gpu_check_within(60, tmp_path)
    assert seconds < 60 + 5, seconds
    assert records[0].startswith("environment    rc=0"), records
    assert any(" not run: " in line for line in records), records

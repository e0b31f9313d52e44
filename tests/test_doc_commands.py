"""Every script command in README.md and docs/*.md parses with the script's own argument parser.

The documented recipes are what users copy; a renamed or removed flag, a bad choice or a config
override the model refuses must fail here, not in a user's shell an hour into a run. Shell variables
assigned in the same block (MT="...", CLF="...") are expanded first. The variants given as comments
("# zformer: --attention_type zformer ...") are checked flag by flag against the --help of the
block's scripts (a comment after a command gives its variants or introduces the next command).

Commands parse in a scratch folder laid out as a fresh checkout (`scratch_checkout`), never in the
repository: what a user's own runs of these commands leave there (the Quickstart's `runs/` folder)
must not turn the check red, since the scripts rightly refuse to write over it.
"""

import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from test_scripts import load_script

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
# plot_curves.py checks in parse_args that each run folder holds a training history.
NEEDS_RUN_FOLDERS = {"plot_curves"}
SCRIPT = re.compile(r"(?:^|\s)scripts/(\w+)\.py(?=\s|$)(.*)")
FLAG = re.compile(r"(?<![\w-])--\w[\w-]*")  # a long option, hyphenated names whole


def _expand(text, env):
    text = re.sub(r"\$\([^)]*\)", "COMMAND_OUTPUT", text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), text)


def _commands():
    """(where, script, argv) for every documented command, and (where, script, flags) for the comment variants."""
    commands, variants = [], []
    for path in DOCS:
        for index, block in enumerate(re.findall(r"```(?:bash|sh)\n(.*?)```", path.read_text(), flags=re.S)):
            env, scripts, comments = {}, [], []
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = line.strip()
                where = f"{path.name} block {index}: {line[:90]}"
                if line.startswith("#"):
                    flags = FLAG.findall(line)
                    if flags and scripts:  # a comment after a command: its variants, or the next command's
                        comments.append((where, flags))
                    continue
                assignment = re.fullmatch(r"(?:export\s+)?(\w+)=(\"[^\"]*\"|\S+)", line)
                if assignment:
                    env[assignment.group(1)] = _expand(assignment.group(2).strip('"'), env)
                    continue
                match = SCRIPT.search(line)
                if not match:
                    continue
                script = match.group(1)
                scripts.append(script)
                args = re.split(r"\s(?:&&|\|\|?|;|>>?|2>)\s", match.group(2).split(" # ")[0])[0]
                if "..." in args:  # an elided example ("scripts/run_translation.py ...")
                    continue
                commands.append((where, script, shlex.split(_expand(args, env))))
            if scripts:
                variants += [(where, tuple(dict.fromkeys(scripts)), flags) for where, flags in comments]
    return commands, variants


COMMANDS, VARIANTS = _commands()
_MODULES = {}


def _module(script):
    if script not in _MODULES:
        _MODULES[script] = load_script(f"{script}.py")
    return _MODULES[script]


def test_docs_have_commands():
    scripts = {script for _, script, _ in COMMANDS}
    assert {"run_translation", "run_classification", "convert_checkpoint", "evaluate_model"} <= scripts
    assert len(VARIANTS) >= 5


PARSED = [c for c in COMMANDS if c[1] not in NEEDS_RUN_FOLDERS]


def _tracked_entries(checkout: Path) -> list[str]:
    """The top-level names git tracks in the repository (what a fresh clone holds); without git,
    the folders the documented commands read from the checkout."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files"], capture_output=True, text=True, check=True)
        names = {line.split("/", 1)[0] for line in listed.stdout.splitlines() if line}
    except (OSError, subprocess.CalledProcessError):
        names = {"docs", "scripts"}
    return sorted(name for name in names if (checkout / name).exists())


def make_scratch_checkout(folder: Path, checkout: Path = REPO_ROOT) -> Path:
    """`folder`/checkout: links to `checkout`'s tracked entries, and ../shared beside it linked to
    the shared data as beside `checkout`; nothing a run of the documented commands wrote there."""
    scratch = folder / "checkout"
    scratch.mkdir(parents=True)
    for name in _tracked_entries(checkout):
        (scratch / name).symlink_to(checkout / name)
    if (checkout.parent / "shared").exists():
        (folder / "shared").symlink_to(checkout.parent / "shared")
    return scratch


def parse_error(script: str, argv: list[str]) -> str | None:
    """Why scripts/<script>.py refuses `argv` (its stderr and exit status), None when it parses."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            _module(script).parse_args(argv)
    except SystemExit as error:
        return f"{stderr.getvalue()[-600:]} (exit {error.code})"
    return None


@pytest.fixture(scope="module")
def scratch_checkout(tmp_path_factory):
    return make_scratch_checkout(tmp_path_factory.mktemp("docs"))


@pytest.mark.parametrize("where,script,argv", PARSED, ids=[f"{i}-{c[1]}" for i, c in enumerate(PARSED)])
def test_documented_command_parses(where, script, argv, scratch_checkout, monkeypatch):
    monkeypatch.chdir(scratch_checkout)
    error = parse_error(script, argv)
    if error is not None:
        pytest.fail(f"{where}\nscripts/{script}.py refuses {argv}:\n{error}")


def _quickstart_leftovers(folder: Path) -> None:
    """The Quickstart's output folder as its run leaves it (the files of a run of the README's
    command), recorded in the library's marker."""
    import hf_zformer.modeling
    from hf_zformer import folders

    code = sorted(p.name for p in Path(hf_zformer.modeling.__file__).parent.glob("*.py") if p.name != "__init__.py")
    written = ["README.md", "all_results.json", "config.json", "eval_history.jsonl", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json", "training_args.json", *code]
    folder.mkdir(parents=True)
    for name in written:
        (folder / name).write_text("{}")
    folders.record(folder, *written)


def test_commands_parse_after_the_quickstart_ran_in_the_checkout(tmp_path, monkeypatch):
    """A user who ran the Quickstart and then the test command: the Quickstart's folder in the
    checkout (the script refuses to start another run over it, rightly) does not fail the check."""
    (quickstart,) = [c for c in PARSED if c[0].startswith("README.md") and c[1] == "run_classification"
                     and "runs/imdb-fastformer" in c[2]]
    _, script, argv = quickstart
    output_dir = Path(argv[argv.index("--output_dir") + 1])
    checkout = make_scratch_checkout(tmp_path / "clone")  # a fresh clone, where the user then ran the Quickstart
    _quickstart_leftovers(checkout / output_dir)
    monkeypatch.chdir(checkout)
    refusal = parse_error(script, argv)
    assert refusal is not None and "holds an earlier run" in refusal, f"this test no longer tests the case: {refusal}"
    scratch = make_scratch_checkout(tmp_path / "scratch", checkout)
    assert not (scratch / output_dir.parts[0]).exists()
    monkeypatch.chdir(scratch)
    assert parse_error(script, argv) is None


@pytest.mark.parametrize("where,scripts,flags", VARIANTS, ids=[f"{i}-{v[1][0]}" for i, v in enumerate(VARIANTS)])
def test_documented_variant_flags_exist(where, scripts, flags):
    known = set()
    for script in scripts:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            _module(script).parse_args(["--help"])
        known |= set(FLAG.findall(out.getvalue()))
    unknown = sorted(set(flags) - known)
    assert not unknown, f"{where}\nno script of the block ({', '.join(scripts)}) has {unknown}"


"""Every script command in README.md and docs/*.md parses with the script's own argument parser.

The documented recipes are what users copy; a renamed or removed flag, a bad choice or a config
override the model refuses must fail here, not in a user's shell an hour into a run. Shell variables
assigned in the same block (MT="...", CLF="...") are expanded first. The variants given as comments
("# zformer: --attention_type zformer ...") are checked flag by flag against the --help of the
block's scripts (a comment after a command gives its variants or introduces the next command).
"""

import contextlib
import io
import re
import shlex

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


@pytest.mark.parametrize("where,script,argv", PARSED, ids=[f"{i}-{c[1]}" for i, c in enumerate(PARSED)])
def test_documented_command_parses(where, script, argv):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            _module(script).parse_args(argv)
    except SystemExit as error:
        pytest.fail(f"{where}\nscripts/{script}.py refuses {argv}:\n{stderr.getvalue()[-600:]} (exit {error.code})")


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


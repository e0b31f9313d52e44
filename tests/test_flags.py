"""One spelling of flags: underscores; the hyphenated spelling is an alias that --help does not show."""

import pytest

from hf_zformer.flags import ArgumentParser


def _parser():
    parser = ArgumentParser(prog="demo")
    parser.add_argument("--max_length", type=int, default=8)
    parser.add_argument("--no_plot", action="store_true")
    parser.add_argument("--names", nargs="+", default=[])
    return parser


def test_hyphenated_flags_are_aliases_of_the_underscored_ones():
    parser = _parser()
    assert vars(parser.parse_args(["--max-length", "3", "--no-plot"])) == vars(
        parser.parse_args(["--max_length", "3", "--no_plot"]))
    assert parser.parse_args(["--max-length=5"]).max_length == 5


def test_help_names_only_the_underscored_spelling(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--max_length" in out and "--max-length" not in out


def test_unknown_flags_stay_errors(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--max-lengths", "3"])
    assert "--max-lengths" in capsys.readouterr().err

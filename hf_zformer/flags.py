"""Command-line flags spelled one way: with underscores (``--max_length``), transformers' convention.

Every script builds its parser with :class:`ArgumentParser`, which also accepts the hyphenated
spelling of a flag (``--max-length``, the spelling the benchmark scripts used to take) as an alias that
``--help`` does not show.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reads ``--some-flag`` (or ``--some-flag=value``) as
    ``--some_flag`` when the parser has the underscored flag and not the hyphenated one."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        import sys

        args = sys.argv[1:] if args is None else list(args)
        end = args.index("--") if "--" in args else len(args)  # after "--" every word is a value
        spelled = [self.underscored(arg) for arg in args[:end]] + args[end:]
        return super().parse_known_args(spelled, namespace)

    def underscored(self, arg):
        """``arg`` with the flag's hyphens as underscores, when that names one of this parser's flags."""
        if not isinstance(arg, str) or not arg.startswith("--") or arg in self._option_string_actions:
            return arg
        flag, equals, value = arg.partition("=")
        underscored = "--" + flag[2:].replace("-", "_")
        return underscored + equals + value if underscored in self._option_string_actions else arg

"""What a run shows while it works (library side, never shipped): progress bars on a terminal only
(:func:`show_bars`), plain log lines in log files (:func:`progress` for evaluation/generation
loops, :func:`speed_line` for the training loop's line every ``--logging_steps``),
:func:`setup_logging` (quiet on non-main processes) and :func:`get_logger` (the process rank in
each line only when there is more than one process)."""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["get_logger", "progress", "setup_logging", "show_bars", "speed_line"]


def show_bars() -> bool:
    """Progress bars only when stderr is a terminal: in a log file every redraw of a bar would be
    kept (carriage returns), so there the scripts write plain log lines instead."""
    return sys.stderr.isatty()


class _TqdmHandler(logging.StreamHandler):
    """Log lines through ``tqdm.write``, which clears the progress bars first and redraws them
    after, so a log line never ends up glued to a bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(accelerator) -> None:
    """INFO logs on the main process (errors only elsewhere). Progress bars (ours, datasets',
    transformers', the Hub's) on the main process of a terminal only (:func:`show_bars`)."""
    import datasets
    import huggingface_hub
    import transformers
    from huggingface_hub.utils import logging as hub_logging

    handler = _TqdmHandler() if show_bars() else logging.StreamHandler()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO, handlers=[handler])
    # These libraries print through their own handler and also propagate to the root one, which
    # showed every Hub warning twice: keep theirs only.
    datasets.utils.logging.disable_propagation()
    hub_logging.disable_propagation()
    if accelerator.is_local_main_process:
        datasets.utils.logging.set_verbosity_warning()
        transformers.utils.logging.set_verbosity_warning()
    else:
        logging.getLogger().setLevel(logging.ERROR)
        datasets.utils.logging.set_verbosity_error()
        transformers.utils.logging.set_verbosity_error()
        hub_logging.set_verbosity_error()
    if not (accelerator.is_local_main_process and show_bars()):
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


class _OneProcessLogger(logging.LoggerAdapter):
    """accelerate's logger interface (``main_process_only=``, ``in_order=``) for a run of one
    process, where every process is the main one: lines without accelerate's ``[RANK 0]`` prefix."""

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        if self.isEnabledFor(level):
            self.logger.log(level, msg, *args, **kwargs)


def get_logger(name: str, accelerator, verbose: bool = False):
    """The scripts' logger: accelerate's (each line names its process, ``[RANK i]``) when more
    than one process runs or with ``verbose``, else the same interface without the prefix."""
    if accelerator.num_processes > 1 or verbose:
        from accelerate.logging import get_logger as multi_process_logger

        return multi_process_logger(name)
    return _OneProcessLogger(logging.getLogger(name), {})


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def speed_line(done: int, total: int | None, elapsed: float, unit: str, new: int | None = None) -> str:
    """``"12.30 steps/s, elapsed 0:00:01, ETA 0:00:02"`` after ``done`` of ``total`` items, ``new``
    of them (default: all) done in the last ``elapsed`` seconds."""
    new = done if new is None else new
    rate = new / elapsed if elapsed > 0 else float("nan")
    text = f"{rate:.2f} {unit}/s, elapsed {_clock(elapsed)}"
    if total is not None and rate > 0 and done < total:
        text += f", ETA {_clock((total - done) / rate)}"
    return text


def progress(iterable, *, desc: str, total: int | None = None, main: bool = True, every_s: float = 30.0):
    """Iterate ``iterable`` with feedback: a tqdm bar on a terminal (main process only; see
    :func:`show_bars`), else on the main process a log line every ``every_s`` seconds and one at
    the end, so that long evaluation or generation loops never run silently."""
    from tqdm.auto import tqdm

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if show_bars() or not main:
        with tqdm(iterable, desc=desc, total=total, disable=not main, leave=False, dynamic_ncols=True, unit="batch") as bar:
            yield from bar
        return
    log = logging.getLogger("hf_zformer.training")  # the logger name these lines have always carried
    log.info(f"{desc}: {total if total is not None else '?'} batches")
    started = last = time.perf_counter()
    done = 0
    for item in iterable:
        yield item
        done += 1
        if time.perf_counter() - last >= every_s:
            last = time.perf_counter()
            log.info(f"{desc}: {done}/{total or '?'} batches, {speed_line(done, total, last - started, 'batches')}")
    log.info(f"{desc}: done {done} batches, {speed_line(done, total, time.perf_counter() - started, 'batches')}")

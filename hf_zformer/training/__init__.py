"""Training: the scripts' arguments, run set-up and finish, the loop, checkpoints, evaluation, batching, scoring, results.
May import: torch, transformers, accelerate, ``hf_zformer.modeling``, the shared utilities and ``data``/``metrics``; never ``conversion``.

The scripts follow transformers' ``examples/pytorch/*_no_trainer.py``: a plain Accelerate loop that
runs unchanged on one process, N GPUs (DDP, FSDP, DeepSpeed) or N CPU processes (gloo), with mixed
precision and the process count chosen by ``accelerate launch``. A script reads as:

* :mod:`.arguments` -- the typed arguments (one dataclass per concern, held by ``RunArguments``),
  argument groups, :func:`~.arguments.parse_run_args` (built and validated once),
  ``--config_overrides``, the config;
* :mod:`.run` -- :func:`~.run.start_run` (accelerator, logging, seed, output directory), data and
  tokenizer helpers, :func:`~.run.finish_run` (model, results, card);
* :mod:`.batching` -- length-grouped batches with dynamic padding;
* :mod:`.loop` -- :func:`~.loop.make_optimizer` and :func:`~.loop.train`;
* :mod:`.evaluation`, :mod:`.checkpoints`, :mod:`.scoring`, :mod:`.results`, :mod:`.feedback`,
  :mod:`.language_modeling` -- what the loop and the scripts call on the way.
"""

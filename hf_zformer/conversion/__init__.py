"""Conversion: pretrained BERT-family encoders and Llama-family decoders into Zformer-family models, attention distillation, teachers.
May import: torch, transformers, ``hf_zformer.modeling`` and the shared utilities; never ``training``.

* :mod:`.convert` -- :func:`~.convert.convert_pretrained` (BERT, RoBERTa, DistilBERT, MiniLM; a
  causal LM goes to :mod:`.convert_decoder`); :mod:`.common` -- what both converters share;
* :mod:`.distillation` -- fitting converted attention to the source's softmax attention;
* :mod:`.decoder_transfer` -- the same for converted decoders, layer by layer; :mod:`.decoder_finetune` --
  their next-token fine-tuning (LoRA or every weight);
* :mod:`.teacher` -- a fine-tuned teacher's predictions as a training loss.
* :mod:`.arguments` -- the conversion scripts' arguments (:class:`~.arguments.ConversionArguments`,
  :class:`~.arguments.LinearizationArguments`), checked once where they are built.
"""

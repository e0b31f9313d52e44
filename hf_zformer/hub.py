"""Model cards (with ``model-index`` metadata) and Hub uploads for trained hf_zformer models.

>>> card = model_card(config=config, results={"eval_accuracy": 0.87}, task="text-classification",
...                   dataset_name="stanfordnlp/imdb", metric_name="accuracy", command="accelerate launch ...")
>>> push_to_hub("runs/imdb-zformer", "me/imdb-zformer")   # create_repo + upload_folder
"""

from __future__ import annotations

import os
from typing import Any

from huggingface_hub import EvalResult, HfApi, ModelCardData

__all__ = ["LICENSE", "check_push_access", "model_card", "push_to_hub", "UPLOAD_IGNORE"]

#: Files of an output folder that are not part of the model (resumable checkpoints, the --save_best copy of the
#: final model, temp folders, logs).
UPLOAD_IGNORE = ["step_*/**", "epoch_*/**", "best/**", ".tmp-*/**", ".old-*/**", "runs/**", "hf_modules/**", "*.pkl", ".lock"]

#: License of the cards' ``license:`` metadata: the checkpoints ship hf_zformer's model code, which is
#: under the project's license (``setup.cfg``).
LICENSE = "apache-2.0"
_TASK_NAMES = {"translation": "Translation", "text-classification": "Text Classification",
               "text-generation": "Causal Language Modeling", "fill-mask": "Masked Language Modeling"}
_EXAMPLES = {"translation": "Ein Mann fährt mit dem Fahrrad durch den Park.", "text-classification": "What a great film!",
             "text-generation": "This movie", "fill-mask": "This movie was <mask>."}
_METRIC_NAMES = {"bleu": "BLEU (sacreBLEU)", "accuracy": "Accuracy", "perplexity": "Perplexity"}


def _attention_summary(config) -> str:
    encoder = config.attention_type if isinstance(config.attention_type, str) else "|".join(config.attention_type)
    if getattr(config, "is_encoder_decoder", False):
        decoder = config.decoder_attention_type
        decoder = decoder if isinstance(decoder, str) else "|".join(decoder)
        return f"encoder {encoder}, decoder {decoder}, cross-attention {config.cross_attention_type}"
    return encoder


def model_card(
    *,
    config,
    results: dict[str, Any],
    task: str,
    dataset_name: str,
    metric_name: str,
    command: str,
    model_name: str | None = None,
    dataset_config: str | None = None,
    languages: list[str] | None = None,
    base_model: str | None = None,
    model_id: str | None = None,
    example: str | None = None,
    hub_dataset: bool = True,
    license: str = LICENSE,
) -> str:
    """A model card: YAML front matter with ``model-index`` (task, dataset, metric name and value for
    every split found in ``results`` as ``<split>_<metric_name>``), ``library_name: transformers``,
    ``license``, ``datasets`` (``dataset_name`` when ``hub_dataset``, i.e. it is a Hub id; nothing
    for local data), tags (hf_zformer, the attention types, the task), then a short description,
    the results table, the exact training command and a usage snippet that runs as written: it
    loads ``model_id`` (a Hub id or folder; default ``model_name``) with ``trust_remote_code=True``
    and translates / classifies / continues ``example`` (default: a German sentence / an English review
    / the start of one)."""
    attention_types = set()
    for field in ("attention_type", "decoder_attention_type") if getattr(config, "is_encoder_decoder", False) else ("attention_type",):
        value = getattr(config, field)
        attention_types.update([value] if isinstance(value, str) else value)
    model_name = model_name or f"{config.model_type}-{task}"
    eval_results = []
    for split, key in (("test", f"test_{metric_name}"), ("validation", f"eval_{metric_name}")):
        if key in results:
            eval_results.append(
                EvalResult(
                    task_type=task,
                    task_name=_TASK_NAMES.get(task, task),
                    dataset_type=dataset_name,
                    dataset_name=dataset_name,
                    dataset_config=dataset_config,
                    dataset_split=split,
                    metric_type=metric_name,
                    metric_name=_METRIC_NAMES.get(metric_name, metric_name),
                    metric_value=round(float(results[key]), 4),
                )
            )
    data = ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag=task,
        tags=["hf_zformer", config.model_type, *sorted(f"{t}-attention" for t in attention_types), task],
        license=license,
        datasets=[dataset_name] if hub_dataset else None,
        language=languages,
        base_model=base_model,
        eval_results=eval_results or None,
    )
    rows = "\n".join(f"| {k} | {v} |" for k, v in results.items())
    usage = _usage(task, model_id or model_name, example if example is not None else _EXAMPLES.get(task, "Hello!"))
    return f"""---
{data.to_yaml()}
---

# {model_name}

A {config.model_type} model ({_attention_summary(config)} attention; hidden size {config.hidden_size},
{config.num_hidden_layers} {"decoder" if task == "text-generation" else "encoder"} layers{f", {config.num_decoder_layers} decoder layers" if getattr(config, "is_encoder_decoder", False) else ""},
{config.num_attention_heads} heads) trained for {task} on `{dataset_name}` with
the hf_zformer scripts{f", fine-tuned from `{base_model}`" if base_model else ""}.

## Results

| metric | value |
| --- | --- |
{rows}

## Training command

```bash
{command}
```

## Usage

The model code ships with the checkpoint (hence `trust_remote_code=True`); only `transformers` and
`torch` are needed:

```python
{usage}
```
"""


def _usage(task: str, model_id: str, example: str) -> str:
    """The card's Python snippet: load ``model_id`` and run it on ``example``."""
    if task == "translation":
        return f"""from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

model_id = {model_id!r}
tokenizer = AutoTokenizer.from_pretrained(model_id, trust_remote_code=True)
model = AutoModelForSeq2SeqLM.from_pretrained(model_id, trust_remote_code=True)
inputs = tokenizer([{example!r}], return_tensors="pt")
outputs = model.generate(**inputs)  # num_beams and max_length from generation_config.json
print(tokenizer.batch_decode(outputs, skip_special_tokens=True)[0])"""
    if task == "text-generation":
        return f"""from transformers import pipeline

model_id = {model_id!r}
generate = pipeline("text-generation", model=model_id, trust_remote_code=True)
print(generate({example!r}, max_new_tokens=30, do_sample=False)[0]["generated_text"])"""
    if task == "fill-mask":
        return f"""from transformers import pipeline

model_id = {model_id!r}
fill = pipeline("fill-mask", model=model_id, trust_remote_code=True)
print(fill({example!r})[0])  # the most likely token for the mask, with its score"""
    return f"""from transformers import pipeline

model_id = {model_id!r}
classify = pipeline({task!r}, model=model_id, trust_remote_code=True)
print(classify({example!r}))  # [{{'label': ..., 'score': ...}}], labels from config.id2label"""


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload model trained with hf_zformer",
) -> str:
    """Create ``repo_id`` (if needed) and upload ``folder`` (model, tokenizer, card, results),
    leaving out resumable checkpoints and logs (:data:`UPLOAD_IGNORE`). Returns the commit URL."""
    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id,
        folder_path=os.fspath(folder),
        repo_type="model",
        commit_message=commit_message,
        ignore_patterns=UPLOAD_IGNORE,
    )
    return str(getattr(info, "commit_url", info))


def check_push_access(repo_id: str, *, token: str | None = None, private: bool | None = None) -> None:
    """Before training: make sure ``repo_id`` exists (``create_repo(exist_ok=True)``) and that the
    token may write it, so that ``--push_to_hub`` fails in seconds rather than after training.
    Raises ``RuntimeError`` with one paragraph (no traceback) saying what failed and what to do."""
    try:
        HfApi(token=token).create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    except Exception as error:  # offline, no/invalid token, no permission, bad repo id, ...
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(
            f"--push_to_hub: cannot create or write the Hub repository {repo_id!r} ({type(error).__name__}: {reason}). "
            "Check the network connection (and HF_HUB_OFFLINE), log in with `hf auth login` or pass --hub_token, "
            "and check --hub_model_id; or run without --push_to_hub (everything is saved in --output_dir) and "
            "upload the folder later."
        ) from None

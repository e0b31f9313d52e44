"""Model cards (with ``model-index`` metadata) and Hub uploads for hf_zformer models.

:func:`model_card` writes the README.md of every folder the library saves: of a model the scripts
trained and of one :func:`hf_zformer.convert_pretrained` converted (with its distillation's fit).

>>> card = model_card(config=config, results={"eval_accuracy": 0.87}, task="text-classification",
...                   dataset_name="stanfordnlp/imdb", metric_name="accuracy", command="accelerate launch ...")
>>> card = model_card(config=converted.config, task="text-classification", base_model="google-bert/bert-base-uncased")
>>> push_to_hub("runs/imdb-zformer", "me/imdb-zformer")   # create_repo + upload_folder
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, HfApi, ModelCardData

__all__ = ["DISTILLATION_SETTINGS", "LICENSE", "check_push_access", "model_card", "push_to_hub", "UPLOAD_IGNORE",
           "weights_failure"]

#: What a converted folder's model card records of its attention distillation (metadata `distillation`):
#: fields of :class:`hf_zformer.conversion.distillation.Distillation`.
DISTILLATION_SETTINGS = ("source", "steps", "model_steps", "batch_size", "max_length", "learning_rate")

#: Files of an output folder that are not part of the model (resumable checkpoints, the --save_best copy of the
#: final model, temp folders, logs).
UPLOAD_IGNORE = ["step_*/**", "epoch_*/**", "best/**", ".hf_zformer-staging-*/**", ".hf_zformer-backup-*/**", "runs/**",
                 "hf_modules/**", "*.pkl", ".lock", ".hf_zformer-output.json"]

#: License of the cards' ``license:`` metadata: the checkpoints ship hf_zformer's model code, which is
#: under the project's license (``setup.cfg``).
LICENSE = "apache-2.0"
_TASK_NAMES = {"translation": "Translation", "text-classification": "Text Classification",
               "text-generation": "Causal Language Modeling", "fill-mask": "Masked Language Modeling"}
_EXAMPLES = {"translation": "Ein Mann fährt mit dem Fahrrad durch den Park.", "text-classification": "What a great film!",
             "text-generation": "This movie", "fill-mask": "This movie was <mask>."}
_METRIC_NAMES = {"bleu": "BLEU (sacreBLEU)", "accuracy": "Accuracy", "perplexity": "Perplexity"}
_AUTO_CLASSES = {"feature-extraction": "AutoModel", "text-classification": "AutoModelForSequenceClassification",
                 "fill-mask": "AutoModelForMaskedLM", "text-generation": "AutoModelForCausalLM",
                 "translation": "AutoModelForSeq2SeqLM"}


def _types_text(value) -> str:
    """An attention type, or a list of them (one per layer): the type when all layers share it."""
    if isinstance(value, str):
        return value
    return value[0] if len(set(value)) == 1 else "|".join(value)


def _attention_summary(config) -> str:
    encoder = _types_text(config.attention_type)
    if getattr(config, "is_encoder_decoder", False):
        decoder = _types_text(config.decoder_attention_type)
        return f"encoder {encoder}, decoder {decoder}, cross-attention {config.cross_attention_type}"
    return encoder


def _tags(config, task: str, converted: bool) -> list[str]:
    """hf_zformer, the model type, ``warm-start`` for a converted model, the attention types, the task."""
    attention_types = set()
    for field in ("attention_type", "decoder_attention_type") if getattr(config, "is_encoder_decoder", False) else ("attention_type",):
        value = getattr(config, field)
        attention_types.update([value] if isinstance(value, str) else value)
    return ["hf_zformer", config.model_type, *(["warm-start"] if converted else []),
            *sorted(f"{t}-attention" for t in attention_types), task]


# `model-index` dataset type of data that is no Hub dataset (a --data_dir folder, a --train_file)
LOCAL_DATASET_TYPE = "local"


def _eval_results(results: dict[str, Any], task: str, dataset_name: str, dataset_config: str | None,
                  metric_name: str | None, hub_dataset: bool = True) -> list[EvalResult]:
    """The ``model-index`` entries: ``metric_name`` on every split found in ``results`` as
    ``test_<metric_name>`` / ``eval_<metric_name>``. A Hub dataset is named by its id; local data
    (``hub_dataset=False``) as ``local data: <name>`` of type :data:`LOCAL_DATASET_TYPE`, which no
    Hub page mistakes for the Hub dataset of the same name."""
    dataset_type = dataset_name if hub_dataset else LOCAL_DATASET_TYPE
    dataset_name = dataset_name if hub_dataset else f"local data: {dataset_name}"
    eval_results = []
    for split, key in (("test", f"test_{metric_name}"), ("validation", f"eval_{metric_name}")):
        if metric_name is not None and key in results:
            eval_results.append(
                EvalResult(
                    task_type=task,
                    task_name=_TASK_NAMES.get(task, task),
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_config=dataset_config,
                    dataset_split=split,
                    metric_type=metric_name,
                    metric_name=_METRIC_NAMES.get(metric_name, metric_name),
                    metric_value=round(float(results[key]), 4),
                )
            )
    return eval_results


def _training_summary(config, task: str, dataset_name: str, base_model: str | None, hub_dataset: bool = True) -> str:
    """What a trained model is: type, attention, size, task, data (a Hub dataset, or local data
    named as such) and starting checkpoint."""
    decoder_layers = f", {config.num_decoder_layers} decoder layers" if getattr(config, "is_encoder_decoder", False) else ""
    return f"""A {config.model_type} model ({_attention_summary(config)} attention; hidden size {config.hidden_size},
{config.num_hidden_layers} {"decoder" if task == "text-generation" else "encoder"} layers{decoder_layers},
{config.num_attention_heads} heads) trained for {task} on {"the Hub dataset" if hub_dataset else "the local data"} `{dataset_name}` with
the hf_zformer scripts{f", fine-tuned from `{base_model}`" if base_model else ""}.
"""


def _conversion_summary(base_model: str, attention: str, distillation: dict | None) -> str:
    """What a converted model is: the source, what carried over, and the distillation's fit when there was one."""
    text = f"""[{base_model}](https://huggingface.co/{base_model}) converted by `hf_zformer.convert_pretrained`
(attention_type={attention}). The embeddings, the feed-forward blocks, the LayerNorms and the task
head carry over unchanged; with `full` attention the model computes what the base model computes.
Other attention types reuse the pretrained projections that map and start the rest fresh (the
mapping is in hf_zformer's docs/warm_start.md), so the model needs fine-tuning before use.
"""
    if distillation is not None:
        text += (
            f"\nAfter conversion the attention of layers {distillation['layers']} was distilled onto the base "
            f"model's softmax attention (`hf_zformer.distill_attention`: {distillation['steps']} layer-wise "
            f"and {distillation['model_steps']} whole-model steps of {distillation['batch_size']} documents of up "
            f"to {distillation['max_length']} tokens, learning rate {distillation['learning_rate']}). Relative "
            f"squared error on held-out documents, before and after: of each layer's attention output "
            f"{distillation['before']} and {distillation['after']}; of the last hidden states "
            f"{distillation['last_layer_before']} and {distillation['last_layer_after']}.\n"
        )
        if "weight_loss_before" in distillation:
            text += (
                f"Layers with a feature map also fitted their attention weights to the softmax weights "
                f"(cross-entropy, weight {distillation['attention_weight_loss']} beside the output error); "
                f"held-out cross-entropy per layer (None: no feature map), before and after: "
                f"{distillation['weight_loss_before']} and {distillation['weight_loss_after']}.\n"
            )
    return text


def model_card(
    *,
    config,
    task: str,
    results: dict[str, Any] | None = None,
    dataset_name: str | None = None,
    metric_name: str | None = None,
    command: str | None = None,
    model_name: str | None = None,
    dataset_config: str | None = None,
    languages: list[str] | None = None,
    base_model: str | None = None,
    model_id: str | None = None,
    example: str | None = None,
    hub_dataset: bool = True,
    license: str = LICENSE,
    distillation: dict[str, Any] | None = None,
) -> str:
    """The model card (README.md) of a model the scripts trained (``dataset_name`` given) or of one
    :func:`hf_zformer.convert_pretrained` converted from ``base_model`` (no ``dataset_name``).

    YAML front matter: ``library_name: transformers``, ``pipeline_tag``, ``license``, tags
    (hf_zformer, the model type, ``warm-start`` for a converted model, the attention types, the
    task), ``base_model``; for a trained model ``model-index`` (task, dataset, metric name and value
    for every split found in ``results`` as ``<split>_<metric_name>``) and ``datasets``
    (``dataset_name`` when ``hub_dataset``, i.e. it is a Hub id; nothing for local data, which the
    card and ``model-index`` name as local data, never as a Hub id); for a
    distilled model ``distillation`` (its settings, :data:`DISTILLATION_SETTINGS`).
    Then a short description (with the distillation's fit, ``distillation`` being the report of
    :func:`hf_zformer.distill_attention` plus its settings), the results table (when ``results``
    is given), the exact training command (when ``command`` is given) and a usage snippet that runs
    as written: it loads ``model_id`` (a Hub id or folder; default the title, ``model_name`` when
    given) with ``trust_remote_code=True`` and, for a trained model, translates / classifies /
    continues ``example`` (default: a German sentence / an English review / the start of one)."""
    converted = dataset_name is None
    if converted and base_model is None:
        raise ValueError("model_card: pass dataset_name (a trained model) or base_model (a converted one)")
    title = model_name or (f"{Path(base_model).name} with {_attention_summary(config)} attention"
                           if converted else f"{config.model_type}-{task}")
    data = ModelCardData(
        model_name=model_name if converted else title,
        library_name="transformers",
        pipeline_tag=task,
        tags=_tags(config, task, converted),
        license=license,
        datasets=[dataset_name] if hub_dataset and not converted else None,
        language=languages,
        base_model=base_model,
        eval_results=None if converted else _eval_results(results or {}, task, dataset_name, dataset_config,
                                                          metric_name, hub_dataset) or None,
    )
    if distillation is not None:  # the settings also as metadata, for result records (results.distillation_of)
        data.distillation = {key: distillation.get(key) for key in DISTILLATION_SETTINGS}
        if "weight_loss_before" in distillation:  # layers with a feature map fitted their weights too
            data.distillation["attention_weight_loss"] = distillation["attention_weight_loss"]
    sections = [f"---\n{data.to_yaml()}\n---\n", f"# {title}\n"]
    if converted:
        sections.append(_conversion_summary(base_model, _attention_summary(config), distillation))
    else:
        sections.append(_training_summary(config, task, dataset_name, base_model, hub_dataset))
    if results is not None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in results.items())
        sections.append(f"## Results\n\n| metric | value |\n| --- | --- |\n{rows}\n")
    if command is not None:
        sections.append(f"## Training command\n\n```bash\n{command}\n```\n")
    model_id = model_id or title
    usage = (_loading(task, model_id) if converted else
             _usage(task, model_id, example if example is not None else _EXAMPLES.get(task, "Hello!")))
    sections.append(
        "## Usage\n\nThe model code ships with the checkpoint (hence `trust_remote_code=True`); only "
        f"`transformers` and\n`torch` are needed:\n\n```python\n{usage}\n```\n"
    )
    return "\n".join(sections)


def _loading(task: str, model_id: str) -> str:
    """A converted card's Python snippet: load ``model_id`` with the task's Auto class (the model
    needs fine-tuning before it is of use)."""
    auto_class = _AUTO_CLASSES.get(task, "AutoModel")
    return f"""from transformers import {auto_class}

model_id = {model_id!r}
model = {auto_class}.from_pretrained(model_id, trust_remote_code=True)  # fine-tune before use"""


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


def weights_failure(error: BaseException) -> str:
    """Why ``from_pretrained`` raised ``error``, in one line: a pickle refused as it could run code
    (without the loader's advice to load it anyway), a truncated or damaged file, a missing shard."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    unpickler = next((line for line in lines if line.startswith("WeightsUnpickler error:")), None)
    if unpickler is not None:
        return (f"a weight file holds objects other than tensors and plain values ({unpickler}); it is not "
                "unpickled, as it could run code")
    return f"{type(error).__name__}: {lines[0]}"

"""The one table of attention types: what each type can do, and the classes that implement it.

Every list of attention types in the package is a view of this table (`attention_types`): the
configurations' choices (`configuration_zformer.ATTENTION_TYPES`, `CAUSAL_ATTENTION_TYPES`,
`CROSS_ATTENTION_TYPES`, `PROBABILITY_ATTENTION_TYPES`, `configuration_zformer_llama.LLAMA_ATTENTION_TYPES`),
the classes the models build (`attention.ATTENTION_CLASSES`, `attention_llama.LLAMA_ATTENTION_CLASSES`)
and the decoding cache's layer of each type (`cache_zformer.ZformerCache`). A view reads the table
when it is used, so a type registered later (`register_attention`) is a valid choice everywhere.

A type's facts (what roles it can play) are declared here for the built-in types, so that the
configuration modules read them without importing torch; the modules that define the classes
attach them (`attention.py`: the `Attention` class and the cache layer; `attention_llama.py`: a
Llama-family class where the generic adapter does not fit). A type defined outside the package
registers everything in one call:

    register_attention("mean", MeanAttention, cache_layer=MeanStateLayer)

This file ships to the Hugging Face Hub with every checkpoint: standard library only.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass


@dataclass
class AttentionType:
    """One attention type.

    - `causal`: it has an exact causal form (decoder self-attention, causal language models and
      Llama-family decoders: output i depends on tokens j <= i only).
    - `cross`: it can attend from a decoder to the encoder's states.
    - `probabilities`: it forms attention probabilities, which `attention_probs_dropout_prob` drops.
    - `encoder`: its `attention.Attention` subclass (every role of the encoder/seq2seq models).
    - `llama`: its Llama-family class (`attention_llama.RotaryAttention` over `encoder`); None: the
      generic adapter of `encoder` (`attention_llama.rotary_adapter`).
    - `cache_layer`: what builds the decoding-cache layer of its causal self-attention (a
      fixed-size state, `cache_zformer.RecurrentLayer`); None: keys and values (`DynamicLayer`).
    """

    name: str
    causal: bool
    cross: bool
    probabilities: bool
    encoder: type | None = None
    llama: type | None = None
    cache_layer: Callable | None = None


_TYPES: dict[str, AttentionType] = {}


def declare_attention(name: str, *, causal: bool, cross: bool, probabilities: bool) -> AttentionType:
    """Add a type's facts to the table (its classes attach with `register_attention`)."""
    if name in _TYPES:
        raise ValueError(f"attention type {name!r} is already declared")
    _TYPES[name] = AttentionType(name, causal=causal, cross=cross, probabilities=probabilities)
    return _TYPES[name]


def register_attention(name: str, encoder: type | None = None, *, llama: type | None = None,
                       cache_layer: Callable | None = None) -> AttentionType:
    """Attach classes to the type `name`; a type not declared yet takes its facts from `encoder`'s
    class attributes (`CAN_BE_CAUSAL`, `CAN_BE_CROSS`, `HAS_ATTENTION_DROPOUT`), and a declared
    type's encoder class must have the declared ones there. The class gets the name as `ATTENTION_TYPE`."""
    entry = _TYPES.get(name)
    if entry is None:
        if encoder is None:
            raise ValueError(f"attention type {name!r} is not declared: pass its `Attention` class")
        entry = declare_attention(name, causal=encoder.CAN_BE_CAUSAL, cross=encoder.CAN_BE_CROSS,
                                  probabilities=encoder.HAS_ATTENTION_DROPOUT)
    if encoder is not None:
        facts = (encoder.CAN_BE_CAUSAL, encoder.CAN_BE_CROSS, encoder.HAS_ATTENTION_DROPOUT)
        if facts != (entry.causal, entry.cross, entry.probabilities):
            raise ValueError(f"{encoder.__name__} (CAN_BE_CAUSAL, CAN_BE_CROSS, HAS_ATTENTION_DROPOUT) = {facts} "
                             f"disagrees with the declared type {entry}")
        entry.encoder = encoder
        encoder.ATTENTION_TYPE = name
    if llama is not None:
        entry.llama = llama
    if cache_layer is not None:
        entry.cache_layer = cache_layer
    return entry


def unregister_attention(name: str) -> None:
    """Take a type registered outside the built-in ones (`register_attention`) off the table."""
    if name in _BUILT_IN:
        raise ValueError(f"attention type {name!r} is built in")
    _TYPES.pop(name, None)


def attention_type(name: str) -> AttentionType:
    """The entry of `name`; a ValueError naming the known types for an unknown one."""
    if name not in _TYPES:
        raise ValueError(f"unknown attention type {name!r}; choose one of {list(_TYPES)}")
    return _TYPES[name]


class AttentionTypes(Sequence):
    """The names of the registered types that have the given facts (`causal=True`, ...), in the
    order they were declared, read from the table at each use: a tuple-like view (`in`, iteration,
    `list(...)`, indexing, equality with a tuple or list)."""

    def __init__(self, **facts: bool):
        self._facts = facts

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, entry in _TYPES.items()
                     if all(getattr(entry, fact) == value for fact, value in self._facts.items()))

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __eq__(self, other) -> bool:
        return isinstance(other, (Sequence, AttentionTypes)) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())


def attention_types(**facts: bool) -> AttentionTypes:
    """The view of the types with these facts (all types without any)."""
    unknown = set(facts) - {"causal", "cross", "probabilities"}
    if unknown:
        raise ValueError(f"unknown attention facts {sorted(unknown)}")
    return AttentionTypes(**facts)


class AttentionClasses(Mapping):
    """type name -> class, for the types of `types` (a view, read at each use): `get_class(entry)`
    gives each class."""

    def __init__(self, types: AttentionTypes, get_class: Callable[[AttentionType], type]):
        self._types, self._get_class = types, get_class

    def __getitem__(self, name: str) -> type:
        if name not in self._types:
            raise KeyError(name)
        return self._get_class(_TYPES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._types)

    def __len__(self) -> int:
        return len(self._types)

    def __repr__(self) -> str:
        return repr(dict(self))


# The built-in types' facts. Xformer's sequence projection mixes future tokens into every key (no
# causal form) and indexes positions of the sequence itself (no cross form); Fastformer's pooled
# global query mixes with each token's own key (no cross form).
declare_attention("full", causal=True, cross=True, probabilities=True)
declare_attention("zformer", causal=True, cross=True, probabilities=False)
declare_attention("xformer", causal=False, cross=False, probabilities=True)
declare_attention("fastformer", causal=True, cross=False, probabilities=False)
_BUILT_IN = frozenset(_TYPES)

__all__ = ["AttentionType", "AttentionTypes", "AttentionClasses", "attention_type", "attention_types",
           "declare_attention", "register_attention", "unregister_attention"]

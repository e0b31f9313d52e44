"""Sharded and data-parallel training: FSDP refuses 0-d parameters, so no model has any."""

import pytest
from model_kinds import cases, model


@pytest.mark.parametrize("kind,attention", cases())
def test_no_parameter_or_buffer_is_0_d(kind, attention):
    built = model(kind, attention)
    scalars = [name for name, t in [*built.named_parameters(), *built.named_buffers()] if t.dim() == 0]
    assert not scalars, scalars

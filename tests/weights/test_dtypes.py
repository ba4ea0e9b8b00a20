"""`model.dtype` names have one home, `tandem.weights.MODEL_DTYPES`, used by trainer and explorer."""

from __future__ import annotations

import typing

import pytest
import torch

from tandem.common.config.model import ModelConfig
from tandem.weights import MODEL_DTYPES, model_dtype


def test_every_dtype_the_config_accepts_has_a_torch_dtype():
    accepted = typing.get_args(ModelConfig.model_fields["dtype"].annotation)
    assert set(accepted) == set(MODEL_DTYPES)
    assert model_dtype("bfloat16") is torch.bfloat16


def test_an_unknown_dtype_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"model.dtype 'int8': expected one of \['bfloat16'"):
        model_dtype("int8")

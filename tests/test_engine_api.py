"""The engine's typed interface to the server (radixkv/engine/api.py): errors that name their
request field (:class:`ParamError`) and how the server reads them."""

from __future__ import annotations

import pickle

import pytest

from radixkv.engine.errors import ParamError
from radixkv.engine.logits_fields import check_token_ids
from radixkv.engine.sampling import SamplingParams
from radixkv.server.intake import make_sampling_params, named_field
from radixkv.server.protocol import APIError


def test_param_error_is_a_value_error_naming_its_field() -> None:
    with pytest.raises(ParamError) as info:
        SamplingParams(top_p=2.0).validate()
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working
    assert info.value.field == "top_p"
    assert str(info.value) == "invalid top_p=2.0: must be in (0, 1]"
    back = pickle.loads(pickle.dumps(info.value))  # a worker process's error keeps its field
    assert (type(back), back.field, str(back)) == (ParamError, "top_p", str(info.value))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"use_beam_search": True, "top_k": 5}, "top_k"),
    ],
)
def test_the_server_answers_the_field_a_param_error_carries(kwargs: dict, field: str) -> None:
    with pytest.raises(APIError) as info:
        make_sampling_params(kwargs)
    assert info.value.status_code == 400
    assert info.value.param == field


def test_the_vocabulary_bound_names_logit_bias() -> None:
    with pytest.raises(ParamError) as info:
        check_token_ids(SamplingParams(logit_bias={70000: 1.0}), 1000)
    assert named_field(info.value) == "logit_bias"


def test_errors_without_a_field_name_none() -> None:
    """Errors about no one field (the prompt's length, an unknown keyword) keep ``param`` None,
    whatever their text says: the field is never parsed out of a message."""
    assert named_field(ValueError("invalid top_p=2: looks like a field")) is None
    with pytest.raises(APIError) as info:
        make_sampling_params({"no_such_knob": 1})
    assert info.value.param is None

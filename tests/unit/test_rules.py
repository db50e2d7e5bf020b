"""rules.py: each input rule, its status, code and message."""

import pytest

from embedsvc import rules
from embedsvc.errors import InvalidRequest


def refused(call, *args, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        call(*args, **kwargs)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize(("inputs", "code", "words"), [
    ([], "empty_input", ["must not be empty"]),
    (["a"] * 9, "too_many_inputs", ["9 inputs", "MAX_INPUTS_PER_REQUEST (8)"]),
    (["ok", ""], "empty_input", ["input 1", "empty string"]),
    ([[1, 2], []], "empty_input", ["input 1", "empty token list"]),
    (["ok", [1, 2]], "invalid_input", ["input 1", "all texts or all token lists"]),
    (["x" * 11], "input_too_long", ["input 0", "11 characters", "MAX_INPUT_CHARS (10)"]),
])
def test_check_inputs(inputs, code, words):
    err = refused(rules.check_inputs, inputs, max_inputs=8, max_chars=10)
    assert err.code == code and err.param == "input"
    for word in words:
        assert word in err.message


def test_check_inputs_accepts_what_fits():
    rules.check_inputs(["x" * 10] * 8, max_inputs=8, max_chars=10)
    rules.check_inputs([[1], [2, 3]], max_inputs=8, max_chars=10)


def test_token_ids_must_be_in_the_vocabulary():
    assert rules.check_token_ids(0, (1, 2), 10) == [1, 2]
    for bad in (-1, 10):
        err = refused(rules.check_token_ids, 3, [1, bad], 10)
        assert err.code == "invalid_token_id" and f"token id {bad}" in err.message
        assert "input 3" in err.message and "0 to 9" in err.message


def test_dimensions_between_one_and_the_model_dimension():
    rules.check_dimensions(None, 4)
    rules.check_dimensions(1, 4)
    rules.check_dimensions(4, 4)
    for bad in (0, 5, -1):
        assert refused(rules.check_dimensions, bad, 4).param == "dimensions"


def test_fit_cuts_from_either_end_or_refuses():
    ids = list(range(10))
    assert rules.fit(0, ids, 4, special=2, truncate=True, direction="right") == [0, 1, 2, 3]
    assert rules.fit(0, ids, 4, special=2, truncate=True, direction="left") == [6, 7, 8, 9]
    assert rules.fit(0, ids, 10, special=2, truncate=False, direction="right") is ids
    err = refused(rules.fit, 2, ids, 4, special=2, truncate=False, direction="right")
    assert err.code == "input_too_long"
    assert "12 tokens" in err.message and "limit of 6" in err.message


def test_a_chunk_must_fit_the_request_limit():
    rules.check_chunk_size(8, 8)
    err = refused(rules.check_chunk_size, 32, 8)
    assert "--chunk-size 32" in err.message and "--max-inputs-per-request" in err.message

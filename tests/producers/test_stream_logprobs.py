"""Token-stream entries carry their tokens' logprobs (protocol 1.2), and a reader by offset trims them with the tokens."""

from producers.deltas import ExactDeltas
from producers.protocol import TokenDelta, TopLogprobs


def logprob(token: int) -> TopLogprobs:
    return TopLogprobs(token_id=token, token=chr(97 + token), bytes=[97 + token], logprob=-0.5 * token, rank=1,
                       top=[{"token_id": token, "token": chr(97 + token), "bytes": [97 + token],
                             "logprob": -0.5 * token, "rank": 1}])


def test_an_entry_round_trips_its_logprobs_through_stream_fields():
    delta = TokenDelta(index=0, offset=2, text="cd", token_ids=[2, 3], logprobs=[logprob(2), logprob(3)])
    fields = delta.to_fields()
    assert set(fields) == {"index", "offset", "text", "token_ids", "logprobs"}
    assert TokenDelta.from_fields({k.encode(): v.encode() for k, v in fields.items()}) == delta
    assert "logprobs" not in TokenDelta(token_ids=[1]).to_fields()  # a job that did not ask writes none


def test_a_repeated_entry_is_trimmed_with_its_logprobs():
    reader = ExactDeltas()
    reader.take(TokenDelta(offset=0, text="ab", token_ids=[0, 1], logprobs=[logprob(0), logprob(1)]))
    # a resumed run wrote tokens 1..3: only 2 and 3 are new, and so are their logprobs
    taken = reader.take(TokenDelta(offset=1, text="bcd", token_ids=[1, 2, 3],
                                   logprobs=[logprob(1), logprob(2), logprob(3)]))
    assert taken.token_ids == [2, 3] and [lp.token_id for lp in taken.logprobs] == [2, 3]


def test_the_prompt_rides_the_first_entry_once():
    """v1.4: the first entry's ``prompt`` field round-trips; a run from the start writes it again
    at offset 0, which a reader by offset drops with that entry's text."""
    prompt = {"prompt_text": "ab", "prompt_first_token": {"token_id": 0, "token": "a", "bytes": [97]},
              "prompt_logprobs": [None, logprob(1)]}
    first = TokenDelta(offset=0, text="c", token_ids=[2], **prompt)
    fields = first.to_fields()
    assert set(fields) == {"index", "offset", "text", "token_ids", "prompt"}
    assert TokenDelta.from_fields(fields) == first and first.prompt_first_token.token == "a"
    reader = ExactDeltas()
    assert reader.take(first).prompt_text == "ab"
    again = reader.take(TokenDelta(offset=0, text="cd", token_ids=[2, 3], **prompt))
    assert again.token_ids == [3] and again.prompt_text is None and again.prompt_logprobs is None

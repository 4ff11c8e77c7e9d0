"""Token ranks as vLLM defines them: how many of a row's logits are at least as large as a token's.

A token more likely than every other is rank 1; tokens that tie share the worse rank, so two
tied for the most likely are both rank 2 (vLLM's ``batched_count_greater_than``, which counts
``logprobs >= the token's``). Compared on the raw logits: the log-softmax only shifts a row.
"""

from __future__ import annotations

import torch


def token_ranks(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(S, 1): the rank of one value per row of ``rows`` (S, V); ``values`` (S, 1) are some of its logits."""
    return (rows >= values).sum(dim=-1, keepdim=True)


def top_ranks(rows: torch.Tensor, top_values: torch.Tensor) -> torch.Tensor:
    """(S, k): the ranks of each row's top k logits ``top_values`` (S, k, largest first), in one
    pass over ``rows`` (S, V): a value above the k-th is outranked only by values among the top
    k; one equal to the k-th also by every equal logit the top k left out."""
    last = top_values[:, -1:]  # (S, 1)
    within = (top_values.unsqueeze(1) >= top_values.unsqueeze(2)).sum(dim=-1)  # (S, k): [s, j] = #{i: top i >= top j}
    return torch.where(top_values > last, within, token_ranks(rows, last))

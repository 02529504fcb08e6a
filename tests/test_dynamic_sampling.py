"""DAPO dynamic sampling bookkeeping, worked by hand."""

import pytest
import torch

from hybridrl.training.dynamic_sampling import fill_informative_groups, informative_groups


def test_informative_groups_are_those_not_all_equal():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.0])
    assert informative_groups(scores, 2).tolist() == [True, False, False, True]
    assert informative_groups(scores, 4).tolist() == [True, True]


def rounds_of(batches):
    calls = []

    def generate(round_index):
        calls.append(round_index)
        return batches[round_index]
    return generate, calls


def test_fill_accumulates_across_rounds_and_counts_what_it_dropped():
    # Round 0: a informative, b all 1, c all 0. Round 1: d informative, e all 1, f and g informative.
    # Target 3: keeps a, d, f; g is surplus; b, c, e discarded; two rounds.
    batches = [[("a", [1, 0]), ("b", [1, 1]), ("c", [0, 0])],
               [("d", [0, 1]), ("e", [1, 1]), ("f", [0.5, 0]), ("g", [1, 0])],
               [("never", [1, 0])]]
    generate, calls = rounds_of(batches)
    result = fill_informative_groups(generate, target=3, max_rounds=5)
    assert result.kept == ["a", "d", "f"] and result.filled
    assert (result.num_discarded, result.num_surplus, result.num_rounds) == (3, 1, 2)
    assert calls == [0, 1]
    # No group of the result has all-equal scores.
    scores = {"a": [1, 0], "d": [0, 1], "f": [0.5, 0]}
    assert all(len(set(scores[g])) > 1 for g in result.kept)


def test_fill_stops_at_the_round_bound():
    generate, calls = rounds_of([[("a", [1, 1])], [("b", [1, 0])], [("c", [0, 1])]])
    result = fill_informative_groups(generate, target=2, max_rounds=2)
    assert result.kept == ["b"] and not result.filled
    assert (result.num_discarded, result.num_surplus, result.num_rounds) == (1, 0, 2)
    assert calls == [0, 1]
    with pytest.raises(ValueError, match="max_rounds >= 1"):
        fill_informative_groups(generate, target=2, max_rounds=0)

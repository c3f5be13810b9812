import pytest

from tokenmill.speculative.ngram import NgramProposer


def test_longest_then_most_recent_match_proposes_what_followed():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # The 3-gram (2, 6, 7) never occurred before; the 2-gram (6, 7) did, most recently at 6..7, followed by 2, 6, 7.
    assert p.propose(tokens) == [2, 6, 7]
    assert p.propose(tokens, k=1) == [2]
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([4, 4]) == [4]  # the occurrence right before, cut at the end
    assert p.propose([7]) == []


def test_a_copy_task_drafts_the_rest_of_the_copied_text():
    text = list(range(100, 130))
    p = NgramProposer(k=5, min_n=2, max_n=4)
    assert p.propose(text + [7] + text[:10]) == text[10:15]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        NgramProposer(k=0)
    with pytest.raises(ValueError):
        NgramProposer(k=2, min_n=3, max_n=2)

"""The Datum wire format: per-token fields cross a process boundary as packed arrays, exact."""

import pickle
import random

import numpy as np
import pytest
import torch

from meshrl.policy import collate, collate_positions
from meshrl.types import Datum


def list_datum(rng: random.Random, n: int, *, ref: bool = True, packed: bool = False) -> Datum:
    return Datum(
        tokens=[rng.randrange(151_936) for _ in range(n)],
        loss_mask=[float(i % 3 != 0) for i in range(n - 1)],
        old_logprobs=[-rng.random() * 7 for _ in range(n - 1)],  # float64 values that float32 would round
        advantage=rng.gauss(0, 1),
        ref_logprobs=[-rng.random() for _ in range(n - 1)] if ref else None,
        positions=([*range(n // 2), *range(n - n // 2)] if packed else None),
    )


def test_pickled_datum_arrives_as_exact_arrays():
    rng = random.Random(0)
    for d in [list_datum(rng, 9), list_datum(rng, 6, ref=False, packed=True)]:
        back = pickle.loads(pickle.dumps(d))
        assert back == d
        assert back.tokens.dtype == np.int64 and back.loss_mask.dtype == np.float64
        assert back.tokens.tolist() == d.tokens  # exact, value by value
        assert back.old_logprobs.tolist() == d.old_logprobs
        assert back.advantage == d.advantage
        assert (back.ref_logprobs is None) == (d.ref_logprobs is None)
        assert (back.positions is None) == (d.positions is None)
        assert pickle.loads(pickle.dumps(back)) == d  # arrays are sent as they are


def test_pickled_batch_is_the_size_of_its_arrays():
    # 8 x 2048 tokens: int64 tokens and three float64 fields, ~393 KB; as pickled Python lists the floats alone
    # were 9 bytes each and the unpickling cost milliseconds of the trainer's time between steps.
    rng = random.Random(1)
    data = [list_datum(rng, 2048) for _ in range(8)]
    raw = 8 * (2048 * 8 + 3 * 2047 * 8)
    assert raw <= len(pickle.dumps(data)) < raw * 1.01


def test_collate_is_the_same_for_lists_and_arrays():
    rng = random.Random(2)
    lists = [list_datum(rng, n, packed=n % 2 == 0) for n in (5, 9, 7, 4)]
    arrays = pickle.loads(pickle.dumps(lists))
    (ta, ba), (tb, bb) = (collate(x, 0, torch.device("cpu"), vocab_size=151_936) for x in (lists, arrays))
    torch.testing.assert_close(ta, tb, rtol=0, atol=0)
    for f in ("mask", "old_logprobs", "advantages", "ref_logprobs"):
        torch.testing.assert_close(getattr(ba, f), getattr(bb, f), rtol=0, atol=0)
    pa, pb = collate_positions(lists, torch.device("cpu")), collate_positions(arrays, torch.device("cpu"))
    torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_from_completion_builds_arrays_once():
    d = Datum.from_completion([5, 6, 7], [8, 9], [-0.5, -0.25], advantage=2.0)
    assert isinstance(d.tokens, np.ndarray) and d.tokens.tolist() == [5, 6, 7, 8, 9]
    assert d.loss_mask.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert d.old_logprobs.tolist() == [0.0, 0.0, -0.5, -0.25]
    assert d.num_loss_tokens == 2 and d == Datum([5, 6, 7, 8, 9], [0, 0, 1, 1], [0, 0, -0.5, -0.25], 2.0)
    assert Datum.from_completion([1], [2]).old_logprobs is None


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Datum.from_completion([1, 2], []), "empty response"),
        (lambda: Datum.from_completion([], [1, 2]), "empty prompt"),
        (lambda: Datum.from_completion([1], [2, 3], [-1.0]), "1 logprobs for 2 response tokens"),
        (lambda: Datum(np.zeros((2, 3), dtype=np.int64), [0.0, 0.0]), "1-D"),
        (lambda: Datum([1, 2, 3], [1.0]), "expected len"),
    ],
)
def test_bad_datum_says_what_is_wrong(call, message):
    with pytest.raises(ValueError, match=message):
        call()

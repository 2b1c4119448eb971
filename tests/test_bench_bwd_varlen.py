"""tools/bench_bwd_varlen.py's FLOP count (CPU only): visible (query, key) pairs per sequence."""

import bench_bwd_varlen  # tools/ is on sys.path (conftest.py)


def test_visible_pairs_full_and_causal():
    assert bench_bwd_varlen.visible_pairs(300, 200, False) == 60000
    assert bench_bwd_varlen.visible_pairs(4, 4, True) == 10  # 1 + 2 + 3 + 4
    # Bottom-right: with 2 queries and 5 keys, query 0 sees keys 0..3, query 1 all 5.
    assert bench_bwd_varlen.visible_pairs(2, 5, True) == 9
    # More queries than keys: the first rows see nothing.
    assert bench_bwd_varlen.visible_pairs(5, 2, True) == 3  # rows 3 and 4 see 1 and 2 keys

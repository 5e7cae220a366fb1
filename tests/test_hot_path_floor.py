"""``python -m experiments hot_path_floor``: the B = 1 exchange in one compiled loop per rank (issue 30).
Its time is only worth comparing if it does the runtime's work: the masked sums must be exact and a bad
message must end the job naming its sender, as in the runtime."""

from __future__ import annotations

import pytest

from experiments.bench_hot_path_floor import compiled_ms, table

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("wait", ["spin", "yield"])
def test_the_compiled_loops_masked_trees_give_every_root_the_exact_sum(wait):
    """γ = 0 and every rank knows every block: each of the 4 × 100 requests' z must equal Σ_l w_l·x_il
    (the loop ends the job otherwise), through the job's own tree pairs and the keystream's masks."""
    result = compiled_ms(400 / 455, wait=wait, mode="check", dataset="breast-cancer", rows=455)
    assert result["checked"] and result["updates"] == 400
    assert result["ms_per_update"] > 0


def test_a_request_for_a_row_past_the_end_ends_the_compiled_loop_naming_its_sender():
    with pytest.raises(RuntimeError, match=r"\[party 0\] party 3 sent a row out of range"):
        compiled_ms(0.2, mode="forge", dataset="breast-cancer", rows=455)


def test_a_diverging_model_ends_the_compiled_loop_through_the_masked_overflow_count():
    """γ = 10^12 on unscaled features: some party's w·x leaves the fixed point's range; it contributes 0 and
    a count that only the root can read (masked like a value), and the root ends the job, as the
    runtime's AggregationOverflowError does."""
    with pytest.raises(RuntimeError, match=r"scores out of the fixed point's range: the model diverged"):
        compiled_ms(0.5, dataset="breast-cancer", rows=455, gamma=1e12)


def test_the_table_states_the_ratio_and_the_load():
    measured = [("vfl train", 0.6), ("compiled, spinning", 0.1), ("vfl train", 0.4),
                ("compiled, spinning", 0.1), ("compiled, yielding", 0.2)]
    runs = [{"method": m, "setting": "alone", "ms_per_update": ms, "load_before": 1.0} for m, ms in measured]
    text = table({"cpu": "x", "command": "c"}, runs)
    assert "| alone | vfl train / compiled, spinning | **5.0×** |" in text
    assert "| alone | vfl train / compiled, yielding | **2.5×** |" in text
    assert "0.500 (0.400–0.600)" in text and "1.0–1.0" in text

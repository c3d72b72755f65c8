"""Workload prompts for the bench and the lossless check: built without vLLM, in milliseconds."""

import numpy as np
import pytest

from specplugin.bench.runner import cell_payload
from specplugin.bench.workloads import (FULL_SIZES, HEADLINE_CELLS, QUICK_CELLS, QUICK_SIZES,
                                        WORKLOADS, Cell, cell_prompts, grid,
                                        source_from_texts)

SPECIAL = 0


def _encode(text: str) -> list[int]:
    """A byte tokenizer shifted by one, so id 0 is free to be the special (eos) token."""
    return [b + 1 for b in text.encode()]


def _source(texts=None):
    texts = texts or [f"def f{i}(x):\n    return x * {i}\n" * 20 for i in range(5)]
    return source_from_texts(texts, _encode, vocab_size=257, special_ids=[SPECIAL])


def test_edit_prompt_is_a_chunk_then_a_separator_then_the_chunks_start_again():
    source = _source()
    cp = cell_prompts(source, FULL_SIZES, Cell("edit", 1, 0.0))
    sep = list(source.separator_ids)
    chunk_len, restart = FULL_SIZES.edit_chunk_len, FULL_SIZES.edit_restart_len
    for prompt in cp.prompts:
        assert len(prompt) == chunk_len + len(sep) + restart
        chunk = list(prompt[:chunk_len])
        assert list(prompt[chunk_len : chunk_len + len(sep)]) == sep
        assert list(prompt[chunk_len + len(sep) :]) == chunk[:restart]


def test_complete_prompts_are_windows_of_the_held_out_stream():
    source = _source()
    stream = source.stream.tolist()
    cp = cell_prompts(source, FULL_SIZES, Cell("complete", 8, 1.0))
    assert len(cp.prompts) == 8
    for prompt in cp.prompts:
        assert len(prompt) == FULL_SIZES.complete_prompt_len
        n = len(prompt)
        assert any(stream[i : i + n] == list(prompt) for i in range(len(stream) - n + 1))


def test_mixed_alternates_edit_and_complete_in_every_batch():
    source = _source()
    cp = cell_prompts(source, FULL_SIZES, Cell("mixed", 8, 0.0))
    lengths = [len(p) for p in cp.prompts]
    edit_len = FULL_SIZES.edit_chunk_len + len(source.separator_ids) + FULL_SIZES.edit_restart_len
    assert lengths == [edit_len, FULL_SIZES.complete_prompt_len] * 4


def test_adversarial_prompts_are_random_ids_without_special_tokens():
    source = _source()
    cp = cell_prompts(source, FULL_SIZES, Cell("adversarial", 16, 1.0))
    ids = np.array(cp.prompts)
    assert ids.shape == (16, FULL_SIZES.random_prompt_len)
    assert ids.min() >= 1 and ids.max() < 257
    assert len(np.unique(ids)) > 100  # spread over the vocabulary, not a pattern


def test_cells_get_different_prompts_and_the_same_cell_the_same_prompts():
    source = _source()
    a = cell_prompts(source, FULL_SIZES, Cell("complete", 1, 0.0))
    b = cell_prompts(source, FULL_SIZES, Cell("complete", 1, 1.0))
    assert a.prompts != b.prompts  # a cross-request cache cannot replay another cell
    assert a == cell_prompts(source, FULL_SIZES, Cell("complete", 1, 0.0))
    assert a.prompts != cell_prompts(source, FULL_SIZES, Cell("complete", 1, 0.0), base_seed=1).prompts


def test_cell_seeds_are_stable_across_processes():
    # crc32, not hash(): the same prompts on every machine and run
    assert Cell("edit", 1, 0.0).seed(0) == 21805515  # zlib.crc32(b"edit/b1/t0")


@pytest.mark.parametrize("cell", grid(WORKLOADS) + list(QUICK_CELLS), ids=lambda c: c.key)
def test_a_tiny_held_out_stream_still_gives_every_cell_its_prompts(cell):
    """A quick zoo holds out only a couple of files; windows then wrap or repeat."""
    source = _source(["x = 1\n"])
    cp = cell_prompts(source, FULL_SIZES, cell)
    assert len(cp.prompts) == FULL_SIZES.num_batches(cell.batch_size) * cell.batch_size
    assert all(len(p) > 0 for p in cp.prompts)


def test_request_counts_per_batch_size():
    assert [FULL_SIZES.num_batches(b) for b in (1, 8, 16)] == [4, 1, 1]
    assert [QUICK_SIZES.num_batches(b) for b in (1, 8, 16)] == [1, 1, 1]


def test_the_grid_follows_the_design():
    cells = grid(WORKLOADS)
    assert len(cells) == 3 * 2 * 2 + 1 + 1 + 1
    assert [c for c in cells if c.workload == "server"] == [Cell("server", 8, 1.0)]
    assert [c for c in cells if c.workload == "adversarial"] == [Cell("adversarial", 16, 1.0)]
    assert [c for c in cells if c.workload == "revisit"] == [Cell("revisit", 1, 0.0)]
    assert {c.batch_size for c in cells
            if c.workload not in ("adversarial", "revisit", "server")} == {1, 8}
    assert {c.temperature for c in cells} == {0.0, 1.0}
    assert set(WORKLOADS) == {"edit", "complete", "mixed", "adversarial", "revisit", "server"}


def test_the_headline_grid_is_the_six_cells_of_the_goals():
    assert [c.key for c in HEADLINE_CELLS] == [
        "edit/b1/t0", "complete/b1/t0", "complete/b8/t0", "server/b8/t1", "complete/b1/t1",
        "adversarial/b16/t1"]


def test_a_server_batch_mixes_greedy_and_sampled_edit_and_complete_requests():
    source = _source()
    cp = cell_prompts(source, FULL_SIZES, Cell("server", 8, 1.0))
    edit_len = FULL_SIZES.edit_chunk_len + len(source.separator_ids) + FULL_SIZES.edit_restart_len
    kinds = [(len(p) == edit_len, t) for p, t in zip(cp.prompts, cp.temperatures)]
    assert kinds == [(True, 0.0), (False, 0.0), (True, 1.0), (False, 1.0)] * 2
    # the per-request temperatures reach the engine child; a uniform cell sends none
    assert cell_payload(cp)["temperatures"] == list(cp.temperatures)
    assert "temperatures" not in cell_payload(cell_prompts(source, FULL_SIZES,
                                                           Cell("complete", 8, 1.0)))


def test_revisit_asks_each_window_again_behind_a_new_header():
    source = _source()
    cp = cell_prompts(source, FULL_SIZES, Cell("revisit", 1, 0.0))
    assert len(cp.prompts) == 4
    bodies = {p[8:] for p in cp.prompts}
    assert len(bodies) == 1  # 4 requests, 1 window: the same file four times
    assert len({p[:8] for p in cp.prompts}) > 1  # each behind its own header


def test_an_empty_stream_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="held-out"):
        source_from_texts([], _encode, vocab_size=257)

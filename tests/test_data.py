"""Poisson sampling, physical chunks, empty batches and resumable positions."""
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from ghostdp.data import BatchTracker, DPDataLoader, PoissonBatchSampler, empty_like_batch, poisson_rate_and_steps
from ghostdp.randomness import RandomSource


def test_each_example_is_drawn_independently_with_the_sample_rate():
    sampler = PoissonBatchSampler(200, 0.1, steps_per_epoch=10, source=RandomSource(seed=0))
    counts = np.zeros(200)
    sizes = []
    for _ in range(50):  # 500 draws
        for batch in sampler:
            counts[batch] += 1
            sizes.append(len(batch))
            assert len(set(batch)) == len(batch)
    # Binomial(500, 0.1) per example: mean 50, sd 6.7; batch size Binomial(200, 0.1): mean 20, sd 4.2.
    assert abs(counts.mean() - 50) < 1.0 and counts.min() > 20 and counts.max() < 80
    assert abs(np.mean(sizes) - 20) < 0.6 and 3.2 < np.std(sizes) < 5.2


def test_ranks_draw_disjoint_shards_that_cover_the_dataset():
    source = RandomSource(seed=1)
    samplers = [PoissonBatchSampler(11, 1.0, 1, source=source, rank=r, world_size=3) for r in range(3)]
    batches = [next(iter(s)) for s in samplers]
    assert sorted(sum(batches, [])) == list(range(11))
    with pytest.raises(ValueError, match="rank"):
        PoissonBatchSampler(11, 0.5, 1, source=source, rank=3, world_size=3)


class Pairs(Dataset):
    def __len__(self):
        return 30

    def __getitem__(self, i):
        return {"input_ids": torch.full((4,), i), "label": i % 2, "text": f"example {i}"}


def test_empty_batches_keep_the_structure_of_the_data():
    batch = empty_like_batch(torch.utils.data.default_collate([Pairs()[0]]))
    assert batch["input_ids"].shape == (0, 4) and batch["label"].shape == (0,) and batch["text"] == []
    loader = DPDataLoader(Pairs(), PoissonBatchSampler(30, 0.01, 20, source=RandomSource(seed=0)))
    empties = [b for b in loader if b["input_ids"].shape[0] == 0]
    assert empties and empties[0]["input_ids"].shape == (0, 4)


def test_chunks_split_each_logical_batch_and_are_reported_in_order():
    tracker = BatchTracker()
    sampler = PoissonBatchSampler(30, 0.5, 3, source=RandomSource(seed=4))
    expected = [sampler.draw(0, b) for b in range(3)]
    loader = DPDataLoader(Pairs(), sampler, max_physical_batch_size=4, tracker=tracker)
    got = []
    for batch in loader:
        chunk = tracker.yielded[-1]
        assert batch["input_ids"].shape[0] <= 4
        if chunk.index == 0:
            got.append([])
        got[-1] += batch["input_ids"][:, 0].tolist()
        assert chunk.logical_size == len(expected[chunk.logical_id])
    assert got == expected


def test_secure_draws_of_other_ranks_are_gathered_not_recomputed():
    sampler = PoissonBatchSampler(30, 0.4, 4, source=RandomSource(secure=True), rank=0, world_size=2)
    with pytest.raises(ValueError, match="cannot be recomputed"):
        sampler.sizes_on_all_ranks(0, 0)


def test_ranks_yield_equal_chunk_counts_padding_with_a_flagged_stand_in_row():
    source, trackers, chunks_of = RandomSource(seed=6), [BatchTracker(), BatchTracker()], [[], []]
    for rank in range(2):
        sampler = PoissonBatchSampler(30, 0.4, 4, source=source, rank=rank, world_size=2)
        for step in range(4):
            assert sampler.sizes_on_all_ranks(0, step) == [len(PoissonBatchSampler(
                30, 0.4, 4, source=source, rank=r, world_size=2).draw(0, step)) for r in range(2)]
        loader = DPDataLoader(Pairs(), sampler, max_physical_batch_size=2, tracker=trackers[rank])
        for batch in loader:
            chunk = trackers[rank].yielded[-1]
            chunks_of[rank].append((chunk.logical_id, chunk.index, chunk.count))
            if chunk.padding:  # one row of example 0; the controller weighs its loss by 0
                assert batch["input_ids"][:, 0].tolist() == [0] and chunk.index * 2 >= chunk.logical_size
            else:
                assert all(i % 2 == rank for i in batch["input_ids"][:, 0].tolist())
    assert chunks_of[0] == chunks_of[1]
    sizes = [[c.logical_size for c in t.yielded if c.index == 0] for t in trackers]
    assert sizes[0] != sizes[1]  # the draws differ, so one rank was padded


def test_a_shared_noise_stream_refuses_two_devices_of_one_type():
    source = RandomSource(seed=1)
    source.shared_across_ranks = True
    source._generator(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="one stream"):
        source._generator(torch.device("cpu", 1))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_loader_continues_with_the_same_batches(num_workers):
    def loader(seed):
        return DPDataLoader(Pairs(), PoissonBatchSampler(30, 0.3, 5, source=RandomSource(seed=seed)),
                            max_physical_batch_size=3, num_workers=num_workers)

    def ids(batch):
        return batch["input_ids"][:, 0].tolist()

    straight = loader(7)
    reference = [ids(b) for _ in range(2) for b in straight]
    first = loader(7)
    taken = []
    for batch in first:  # stop after two whole logical batches; workers have drawn further ahead
        taken.append(ids(batch))
        if first.tracker.yielded[-1].is_last and first.tracker.yielded[-1].logical_id == 1:
            break
    state = first.state_dict()
    resumed = loader(123)
    resumed.logical_batches.source.seed = 7  # the engine restores the seed with its random state
    resumed.load_state_dict(state)
    rest = [ids(b) for b in resumed] + [ids(b) for b in resumed]
    assert taken + rest[:len(reference) - len(taken)] == reference


def test_the_sample_rate_and_epoch_of_poisson_batches():
    """q = batch_size * world_size / n (at most 1), ceil(n / (batch_size * world_size)) steps; no dataset, no q."""
    assert poisson_rate_and_steps(8, 1, 100) == (0.08, 13)
    assert poisson_rate_and_steps(8, 4, 100) == (0.32, 4)  # each process's batch_size is its share
    assert poisson_rate_and_steps(64, 2, 100) == (1.0, 1)
    with pytest.raises(ValueError, match="training dataset is empty"):
        poisson_rate_and_steps(8, 1, 0)

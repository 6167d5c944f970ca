"""Noise streams: large CPU tensors draw their blocks from fixed sub-streams, in parallel, reproducibly."""
import torch

from ghostdp.randomness import CPU_NOISE_STREAMS, NOISE_BLOCK, RandomSource

N = 3 * CPU_NOISE_STREAMS * NOISE_BLOCK // 2 + 1234  # several blocks per sub-stream and a partial last block


def test_large_tensors_take_block_j_from_sub_stream_j_mod_streams():
    got = torch.zeros(N, dtype=torch.float32)
    RandomSource(seed=9).add_gaussian_(got, 0.5)
    reference_source = RandomSource(seed=9)
    generators = [reference_source._generator(torch.device("cpu"), k) for k in range(CPU_NOISE_STREAMS)]
    expected = torch.empty(N, dtype=torch.float32)
    for j, lo in enumerate(range(0, N, NOISE_BLOCK)):
        hi = min(N, lo + NOISE_BLOCK)
        expected[lo:hi] = torch.empty(hi - lo, dtype=torch.float32).normal_(0.0, 0.5, generator=generators[j % CPU_NOISE_STREAMS])
    assert torch.equal(got, expected)
    blocks = got[:CPU_NOISE_STREAMS * NOISE_BLOCK].reshape(CPU_NOISE_STREAMS, NOISE_BLOCK)
    assert all(not torch.equal(blocks[0], blocks[k]) for k in range(1, CPU_NOISE_STREAMS))  # distinct streams
    assert abs(float(got.std()) / 0.5 - 1) < 0.01 and abs(float(got.mean())) < 0.005


def test_a_small_tensor_gets_exactly_the_values_of_gaussian_like():
    got = torch.zeros(1000, dtype=torch.float32)
    RandomSource(seed=2).add_gaussian_(got, 3.0)
    assert torch.equal(got, RandomSource(seed=2).gaussian_like(torch.zeros(1000, dtype=torch.float32), 3.0))


def test_saved_state_resumes_every_sub_stream():
    source = RandomSource(seed=4)
    source.add_gaussian_(torch.zeros(N, dtype=torch.float32), 1.0)
    state = source.state_dict()
    assert len(state["generators"]) == CPU_NOISE_STREAMS
    continued = torch.zeros(N, dtype=torch.float32)
    source.add_gaussian_(continued, 1.0)
    resumed_source = RandomSource(seed=123)
    resumed_source.load_state_dict(state)
    resumed = torch.zeros(N, dtype=torch.float32)
    resumed_source.add_gaussian_(resumed, 1.0)
    assert torch.equal(resumed, continued)


def test_the_divisor_applies_to_gradient_and_noise_alike():
    grad = torch.linspace(-1, 1, N, dtype=torch.float32)
    for tensor in (grad.clone(), grad.clone()[::2], grad.clone()[:1000]):  # blocks, non-contiguous, one block
        divided = tensor.clone()
        RandomSource(seed=5).add_gaussian_(divided, 2.0, divisor=8.0)
        undivided = tensor.clone()
        RandomSource(seed=5).add_gaussian_(undivided, 2.0)
        assert torch.equal(divided, undivided / 8.0)


def test_several_tensors_draw_one_stream_over_their_concatenation():
    # Sizes that cross block boundaries; the float64 tensor is a group of its own (another dtype),
    # drawn after the float32 group from the same generator.
    sizes = [7, NOISE_BLOCK - 3, 2 * NOISE_BLOCK + 11, 1, 3 * NOISE_BLOCK]
    tensors = [torch.linspace(-1, 1, n, dtype=torch.float32) for n in sizes]
    wide = torch.ones(5, 4, dtype=torch.float64)
    got = [t.clone() for t in tensors] + [wide.clone()]
    RandomSource(seed=3).add_gaussian_(got, 0.5, divisor=4.0)
    reference = RandomSource(seed=3)
    concatenation, alone = torch.cat(tensors), wide.clone()
    reference.add_gaussian_(concatenation, 0.5, divisor=4.0)
    reference.add_gaussian_(alone, 0.5, divisor=4.0)
    assert torch.equal(torch.cat(got[:-1]), concatenation)
    assert torch.equal(got[-1], alone) and not torch.equal(alone, wide / 4.0)


def test_secure_noise_reaches_every_tensor_once_with_the_right_variance():
    tensors = [torch.zeros(300, 100), torch.zeros(20_000)]
    RandomSource(secure=True).add_gaussian_(tensors, 2.0)
    for t in tensors:
        assert abs(float(t.std()) / 2.0 - 1) < 0.05 and abs(float(t.mean())) < 0.1
    assert not torch.equal(tensors[0].flatten()[:20_000], tensors[1])


def test_one_source_over_changing_layouts_draws_what_one_tensor_per_call_would():
    # The scratch buffer's views are kept per layout; a later layout, and a scratch buffer that grows
    # (the first call needs 12 values, the second several blocks), must not reuse stale ones.
    layouts = [[5, 7], [NOISE_BLOCK - 3, 10, NOISE_BLOCK], [5, 7], [3, 9], [NOISE_BLOCK - 3, 10, NOISE_BLOCK]]
    source, reference = RandomSource(seed=6), RandomSource(seed=6)
    for sizes in layouts:
        tensors = [torch.linspace(-1, 1, n, dtype=torch.float32) for n in sizes]
        concatenation = torch.cat(tensors)
        source.add_gaussian_(tensors, 0.5, divisor=3.0)
        reference.add_gaussian_(concatenation, 0.5, divisor=3.0)
        assert torch.equal(torch.cat(tensors), concatenation)

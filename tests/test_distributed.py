"""Several processes (DDP on gloo, CPU, 2 ranks under torchrun) against a single-process reference.

The workers live in distributed_worker.py; each launch runs both ranks and saves what they saw.
"""
import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import distributed_worker as worker
from ghostdp.data import PoissonBatchSampler
from ghostdp.randomness import RandomSource
from test_trainer import Examples, bert, cross_entropy, reference_step

WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))


# The README's command for K processes on CPU with accelerate: `accelerate launch --cpu --num_processes K`
# starts one process (accelerate's simple launcher); --multi_gpu starts K through torchrun, and
# ACCELERATE_USE_CPU=1 makes each one use the CPU and gloo.
ACCELERATE_ON_CPU = ["-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={WORLD}",
                     "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]


def launch(scenario, tmp_path, launcher="torchrun"):
    """Runs ``scenario`` on WORLD ranks and returns what each saved. A launch in which a rank was killed by a
    signal (once, under load: gloo aborted rank 0 mid-collective, SIGABRT) is run once more, with a warning
    that names it; a rank that fails by itself (an exception, a wrong result) fails the test at once. Each
    rank's own output is kept (--tee) and shown on failure: the launcher's tail holds only the last rank's."""
    logs = tmp_path / "logs0"
    done = _launch_once(scenario, tmp_path, launcher, logs)
    if done.returncode != 0 and _killed_by_signal(done):
        warnings.warn(f"distributed scenario '{scenario}' ({launcher}): a rank was killed by a signal; running it "
                      f"once more. First attempt:\n{_failure_report(done, logs)}")
        logs = tmp_path / "logs1"
        done = _launch_once(scenario, tmp_path, launcher, logs)
    assert done.returncode == 0, _failure_report(done, logs)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _launch_once(scenario, tmp_path, launcher, logs):
    """One launch of ``scenario``, each rank's output also written under ``logs``."""
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                   f"--log-dir={logs}", "--tee=3"]
        env = {}
    else:
        command, env = [sys.executable, *ACCELERATE_ON_CPU, f"--log_dir={logs}", "--tee=3"], {"ACCELERATE_USE_CPU": "1"}
    command += [os.path.join(HERE, "distributed_worker.py"), scenario, str(tmp_path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **env))


def _killed_by_signal(done) -> bool:
    """Whether the rank whose failure came first died by a signal: torchrun's "Root Cause" entry has a negative
    exitcode (the other ranks are then stopped with SIGTERM, which says nothing)."""
    root = (done.stdout + done.stderr).rpartition("Root Cause")[2]
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    return code is not None and int(code.group(1)) < 0


def _failure_report(done, logs) -> str:
    """The launcher's tail, then the tail of each rank's own output."""
    parts = [done.stdout[-2000:] + done.stderr[-4000:]]
    for log in sorted(logs.rglob("*.log")) if logs.exists() else ():
        text = log.read_text(errors="replace")
        if text.strip():
            parts.append(f"--- {log.relative_to(logs)}:\n{text[-3000:]}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    return launch("engine", tmp_path_factory.mktemp("engine"))


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    return launch("trainer", tmp_path_factory.mktemp("trainer"))


@pytest.fixture(scope="module")
def accelerate_trainer_runs(tmp_path_factory):
    return launch("trainer", tmp_path_factory.mktemp("accelerate"), launcher="accelerate")


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    return launch("fsdp", tmp_path_factory.mktemp("fsdp"))


def draws(seed, n, rate, steps, step):
    """Each rank's own Poisson draw for this step, recomputed in this process."""
    return [PoissonBatchSampler(n, rate, steps, source=RandomSource(seed=seed), rank=r, world_size=WORLD).draw(0, step)
            for r in range(WORLD)]


def reference_engine_run(seed, steps):
    """Single process, per-example loop: clip each example of the union of the ranks' draws, sum, divide by
    the expected batch size over all ranks, SGD step."""
    model, data = worker.mlp(), worker.data()
    rate = worker.PER_RANK_BATCH * WORLD / worker.N
    for step in range(steps):
        union = sorted(i for rank_draw in draws(seed, worker.N, rate, steps, step) for i in rank_draw)
        total = [torch.zeros_like(p) for p in model.parameters()]
        for i in union:
            x, y, _ = data[i]
            grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x[None]), y[None]),
                                        list(model.parameters()))
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
            for t, g in zip(total, grads):
                t += min(1.0, worker.C / (norm + 1e-6)) * g
        with torch.no_grad():
            for p, t in zip(model.parameters(), total):
                p -= worker.LR * t / (worker.PER_RANK_BATCH * WORLD)
    return dict(model.named_parameters())


@pytest.mark.parametrize("run", ["after_chunked", "first_unseeded", "bookkeeping", "bookkeeping_checkpointed"])
def test_noise_free_update_equals_one_process_on_the_union_of_the_ranks_examples(engine_runs, run):
    ranks = [r[run] for r in engine_runs]
    seed = ranks[0]["seed"]
    assert ranks[1]["seed"] == seed  # an unseeded engine takes rank 0's seed everywhere
    steps = ranks[0]["steps"]
    assert steps == worker.N // (worker.PER_RANK_BATCH * WORLD)
    rate = worker.PER_RANK_BATCH * WORLD / worker.N
    for step in range(steps if "indices" in ranks[0] else 0):  # each rank trained on its own shard's draw
        for rank, rank_draw in enumerate(draws(seed, worker.N, rate, steps, step)):
            assert sorted(ranks[rank]["indices"][step]) == rank_draw
            assert all(i % WORLD == rank for i in rank_draw)
    reference = reference_engine_run(seed, steps)
    for rank in ranks:
        for name, value in reference.items():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-10, atol=1e-12)


def test_chunked_ranks_run_equal_numbers_of_backward_calls_and_the_step_sums_them_in_one_all_reduce(engine_runs):
    """Two passes write their clipped sums themselves (pass 2 repeats pass 1's backward, which forms no weight
    gradient): DDP's reducer never all-reduces, in either pass; the step sums the ranks' clipped sums in one
    bucketed all-reduce per logical batch, however many physical chunks it had."""
    ranks = [r["after_chunked"] for r in engine_runs]
    sizes = [[len(s) for s in r["indices"]] for r in ranks]
    assert sizes[0] != sizes[1]  # the ranks' draws differ, so padding chunks were needed
    assert ranks[0]["backward_calls"] == ranks[1]["backward_calls"] == sum(
        max(math.ceil(a / 2), math.ceil(b / 2), 1) for a, b in zip(*sizes))
    for rank in ranks:
        assert rank["in_norm_pass"] == [] and rank["buckets"] == [1] * rank["steps"]


def test_noise_is_one_shared_draw_with_variance_sigma_squared_c_squared(engine_runs):
    noise = [r["noise"] for r in engine_runs]
    assert torch.equal(noise[0], noise[1])  # identical on both ranks: added once, not once per rank
    sigma_c = 2.0 * worker.C
    n = noise[0].numel()
    # Sample variance of n normals: relative standard error sqrt(2 / n) = 1.3%; allow 5 of them.
    assert abs(float(noise[0].var()) / sigma_c ** 2 - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(noise[0].mean())) < 5 * sigma_c / math.sqrt(n)


@pytest.mark.parametrize("case, error, match", [
    ("secure_mode", "NotImplementedError", "secure_mode with several processes"),
    ("different_seeds", "ValueError", "different seeds"),
    ("fixed_batches_unsharded", "ValueError", "DistributedSampler"),
    ("unwrapped", None, ""),  # the step sums the ranks' clipped sums itself: a forward without DDP is not misuse
    ("replicas_differ", "PrivacyStepError", "weights differ between processes at the first step"),
    ("noise_not_shared", "PrivacyStepError", "noise differs"),
])
def test_multi_process_misuse_is_refused_on_every_rank(engine_runs, case, error, match):
    for rank in engine_runs:
        assert rank["refusals"][case][0] == error and match in rank["refusals"][case][1]


def test_the_forward_checks_eval_reruns_run_in_step_and_every_rank_refuses_what_any_rank_found(engine_runs):
    padding = "the model's outputs depend on how far the batch is padded"
    elsewhere = "another process found that the model's forward depends on how far the batch is padded"
    for rank, run in enumerate(engine_runs):
        checks = run["forward_checks"]
        # Each process pads its batches to one length of its own (4 and 6): they differ between the processes.
        assert checks["padding_everywhere"][0] == "RuntimeError"
        assert re.search(padding + r".*lengths differ \(\d on this process, 4 to 6 on all\)",
                         checks["padding_everywhere"][1])
        # Process 1's batch of one example has nothing to compare: it reruns in step, and stops with process 0.
        assert checks["padding_on_one"][0] == "RuntimeError"
        assert (padding if rank == 0 else elsewhere) in checks["padding_on_one"][1]
        assert checks["masked"] == (None, "")  # a pooling that reads the mask: no refusal, no process left waiting
        # One process pads by one position only (no room for 8 more): both take the second attempt in step.
        assert checks["padded_by_one"][True] == (None, "")
        assert checks["padded_by_one"][False][0] == "RuntimeError"
        assert re.search(padding + r".*by %d more positions" % [1, 8][rank], checks["padded_by_one"][False][1])
        assert checks["batch_size"][0] == "RuntimeError"
        assert "removing the last of the 4 examples" in checks["batch_size"][1]
        assert checks["counted_padding"][0] == "ValueError"
        assert ("the loss counts positions that the batch's attention mask excludes" if rank == 0 else
                "another process found that the loss counts positions") in checks["counted_padding"][1]
        assert checks["batch_size_on_one"][0] == "RuntimeError"
        assert ("removing the last of the 4 examples" if rank == 0 else
                "another process found that the model's forward mixes examples") in checks["batch_size_on_one"][1]


def test_bookkeeping_sums_the_ranks_in_one_bucketed_all_reduce_per_step(engine_runs):
    for rank in engine_runs:
        run = rank["bookkeeping"]
        assert run["buckets"] == [1] * run["steps"]  # 4 parameters, one float64 bucket, once per logical batch
        # Under checkpointing book-keeping takes two passes, which write their sums themselves too.
        run = rank["bookkeeping_checkpointed"]
        assert run["buckets"] == [1] * run["steps"]


@pytest.mark.parametrize("run", ["adapters", "adapters_checkpointed"])
def test_two_passes_take_one_backward_for_adapters_on_every_rank_alike(engine_runs, run):
    """The ranks agree on what book-keeping keeps at each step's all-reduce (the largest of their measures), so
    every rank switches at the same logical batch, and the weights are those of two passes throughout; also under
    non-reentrant checkpointing."""
    for rank in engine_runs:
        switched, two_passes = rank[run][True], rank[run][False]
        for name, p in two_passes["params"].items():
            torch.testing.assert_close(switched["params"][name], p, rtol=1e-10, atol=1e-12)
        assert not any(two_passes["wrote"]) and switched["agreed"][0] < 1 / 8
        wrote = switched["wrote"]
        first = wrote.index(True)  # the first logical batch measures in two passes, the rest take one backward
        assert 0 < first and all(wrote[first:])
    assert engine_runs[0][run][True]["wrote"] == engine_runs[1][run][True]["wrote"]


@pytest.mark.parametrize("runs, run", [("trainer_runs", "exact"), ("accelerate_trainer_runs", "exact"),
                                       ("trainer_runs", "bookkeeping")])
def test_dp_trainer_under_torchrun_or_accelerate_equals_one_process_on_the_union(runs, run, request):
    ranks = [r[run] for r in request.getfixturevalue(runs)]
    assert all(r["world_size"] == WORLD for r in ranks)
    data, model = Examples(), bert()
    per_rank, n = 3, len(data)
    rate = per_rank * WORLD / n
    steps_per_epoch = math.ceil(n / (per_rank * WORLD))
    assert ranks[0]["expected_batch_size"] == pytest.approx(per_rank * WORLD)
    for step in range(ranks[0]["steps"]):
        union = sorted(i for d in draws(7, n, rate, steps_per_epoch, step) for i in d)
        model = reference_step(model, data, union, 0.3, worker.LR, per_rank * WORLD, cross_entropy)
    for rank in ranks:
        for name, value in model.named_parameters():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("runs", ["trainer_runs", "accelerate_trainer_runs"])
def test_dp_trainer_refuses_a_mean_over_dynamic_padding_on_every_rank(runs, request):
    """Each process pads its batches to their longest example; the forward check's eval() reruns run in step
    through the DDP wrapper that the Trainer (or accelerate) puts around the model, called by keyword."""
    for rank in request.getfixturevalue(runs):
        padding = rank["dynamic_padding"]
        assert padding["bert"] == (None, "")
        assert padding["mean over padding"][0] == "RuntimeError"
        assert re.search(r"(the model's outputs|another process found that the model's forward) depends? on how far "
                         r"the batch is padded", padding["mean over padding"][1])


def test_dp_trainer_ranks_stay_identical_with_noise(trainer_runs):
    ranks = [r["noisy"] for r in trainer_runs]
    assert ranks[0]["epsilon"] == ranks[1]["epsilon"] > 0
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name])
    assert any(not torch.equal(value, trainer_runs[0]["exact"]["params"][name])
               for name, value in ranks[0]["params"].items())


@pytest.mark.parametrize("run", ["exact", "chunked", "input_grad"])
def test_fsdp_noise_free_update_equals_one_process_on_the_union_of_the_ranks_examples(fsdp_runs, run):
    ranks = [r[run] for r in fsdp_runs]
    seed, steps = ranks[0]["seed"], ranks[0]["steps"]
    assert ranks[1]["seed"] == seed and steps == worker.N // (worker.PER_RANK_BATCH * WORLD)
    rate = worker.PER_RANK_BATCH * WORLD / worker.N
    for step in range(steps):  # each rank computed the norms of its own draw, from full activations
        for rank, rank_draw in enumerate(draws(seed, worker.N, rate, steps, step)):
            assert sorted(ranks[rank]["indices"][step]) == rank_draw
    reference = reference_engine_run(seed, steps)
    for rank in ranks:
        for name, value in reference.items():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("run", ["noise", "secure_noise"])
def test_fsdp_ranks_add_independent_noise_to_their_own_shards_with_variance_sigma_squared_c_squared(fsdp_runs, run):
    own = [r[run] for r in fsdp_runs]
    sigma_c = 2.0 * worker.C
    for noise in own:
        n = noise.numel()
        assert abs(float(noise.var()) / sigma_c ** 2 - 1) < 5 * math.sqrt(2 / n)
        assert abs(float(noise.mean())) < 5 * sigma_c / math.sqrt(n)
    # The shards are different elements: one shared stream would give them identical noise.
    m = min(x.numel() for x in own)
    correlation = float(torch.corrcoef(torch.stack([own[0][:m], own[1][:m]]))[0, 1])
    assert abs(correlation) < 5 / math.sqrt(m)


def test_fsdp_sharded_checkpoint_resumes_exactly_as_the_uninterrupted_run(fsdp_runs):
    for rank in fsdp_runs:
        assert rank["resumed"]["steps"] == 2
        for name, value in rank["uninterrupted"]["params"].items():
            torch.testing.assert_close(rank["resumed"]["params"][name], value, rtol=0, atol=0)
    assert any(not torch.equal(fsdp_runs[0]["uninterrupted"]["params"][n], v)  # the noise was on
               for n, v in fsdp_runs[0]["exact"]["params"].items())


def test_fsdp_bookkeeping_and_the_automatic_physical_batch_are_refused_with_the_fix(fsdp_runs):
    for rank in fsdp_runs:
        error, message = rank["bookkeeping"]
        assert error == "NotImplementedError" and "clipping='ghost'" in message
        error, message = rank["automatic_physical_batch"]
        assert error == "ValueError" and "give max_physical_batch_size as a number" in message


def test_fsdp_refuses_a_pass_two_whose_output_grads_differ_from_pass_ones(fsdp_runs):
    """FSDP2's sums are reduce-scattered as pass 2 writes them: they cannot be scaled to keep each example within C
    where the backward is not deterministic (pass_two.py), so every rank refuses the step, naming the fix."""
    for rank in fsdp_runs:
        assert re.search(r"module 'first' received different ones.*FSDP2-sharded parameters.*cannot scale them.*"
                         r"use_deterministic_algorithms", rank["pass_two_differs"]), rank["pass_two_differs"]


def test_fsdp_unit_without_a_norm_rule_goes_through_the_fallback_exactly(fsdp_runs):
    for rank in fsdp_runs:
        assert rank["fallback_error"] < 1e-10


def test_accelerates_fsdp2_preparation_is_exact_whether_ghostdp_attaches_before_or_after_it(fsdp_runs):
    for rank in fsdp_runs:
        assert set(rank["accelerate_errors"]) == {"shard, then attach", "attach, then shard"}
        assert all(error < 1e-10 for error in rank["accelerate_errors"].values()), rank["accelerate_errors"]


@pytest.mark.parametrize("also_called", [True, False])
def test_fsdp_parameter_read_outside_its_module_is_refused(fsdp_runs, also_called):
    # FSDP2 gathers the weight into another tensor for the forward; a read of that tensor alone (never
    # through lin's forward) went unseen by the graph audit before the gathered parameters were tracked.
    for rank in fsdp_runs:
        message = rank["stray_read"][also_called]
        assert message is not None and "'lin.weight' outside the forward" in message

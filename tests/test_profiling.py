"""The profiling tools run end to end on a tiny model (their figures are printed, never asserted)."""
import io
import json
import math
import subprocess
import tarfile

import pytest
import torch

import ghostdp
from profiling import bench, layers, revision, step_ratio
from ghostdp.norms.factors import gram_tile, prefers_gram

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "8"]


def test_bench_runs_each_mode_in_a_fresh_process_and_writes_table_json_and_plot(tmp_path, capsys):
    results = bench.main(TINY + ["--batches", "2", "--steps", "2", "--warmup", "1", "--modes", "plain", "ghost",
                                 "bookkeeping", "--out", str(tmp_path)])
    for mode in ("plain", "ghost", "bookkeeping"):
        assert "error" not in results[mode][2], results[mode][2]
        assert results[mode][2]["median_ms"] > 0 and math.isfinite(results[mode][2]["peak_mb"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["results"]) == {"plain", "ghost", "bookkeeping"}
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "time/plain" in capsys.readouterr().out


def test_tensor_peak_is_the_largest_set_of_tensors_alive_at_once_above_those_alive_before():
    import torch
    mib = dict(size=(2 ** 18,), dtype=torch.float32)
    kept = torch.ones(**mib)  # 1 MiB alive before the step: not counted

    def step():
        a = torch.empty(3, *mib["size"], dtype=torch.float32)
        b = torch.empty(**mib)  # a and b: 4 MiB at once
        del a, b
        c = torch.empty(2, *mib["size"], dtype=torch.float32)  # 2 MiB, once they are freed
        c.copy_(kept.repeat(2, 1))  # and 2 MiB of a temporary: 4 MiB again, not more

    assert bench.tensor_peak_mb(step) == pytest.approx(4.0, abs=0.01)


def _three_mib_made_by_a_named_function(mib):
    import torch
    return torch.ones(3, *mib["size"], dtype=torch.float32)


def test_peak_lists_the_tensors_alive_at_the_peak_by_the_op_and_frames_that_made_them():
    """A tensor made before the step and freed inside it counts for nothing (it is not the step's)."""
    import torch
    from profiling import peak
    mib = dict(size=(2 ** 18,), dtype=torch.float32)
    state = {"before": torch.ones(**mib)}

    def step():
        state["before"] = None
        kept = torch.zeros(**mib)  # 1 MiB to the end
        big = _three_mib_made_by_a_named_function(mib)  # with kept: the peak, 4 MiB
        del big
        small = torch.ones(2, *mib["size"], dtype=torch.float32)  # 3 MiB with kept: below the peak
        del small, kept

    held = peak.peak_holdings(step)
    assert held["peak_mb"] == pytest.approx(4.0, abs=0.01)
    sizes = {label.split(" <- ")[0]: round(size, 2) for size, label in held["holders"]}
    assert sizes == {"aten::ones": 3.0, "aten::zeros": 1.0}, held["holders"]
    assert "_three_mib_made_by_a_named_function" in held["holders"][0][1]


def test_peak_runs_on_a_tiny_model_in_each_mode(capsys):
    from profiling import peak
    for mode in ("plain", "ghost", "bookkeeping"):
        peak.main(TINY + ["--batch", "2", "--mode", mode, "--top", "3"] + (["--proof"] if mode == "ghost" else []))
    out = capsys.readouterr().out
    assert "plain, a step between proofs: peak" in out and "ghost, a proof step: peak" in out
    assert "bookkeeping, a step between proofs: peak" in out
    # Each section lists its largest holdings at the peak, by the op or autograd node that allocated them.
    assert out.count(" MB  ") >= 3 * 3 and " MB  AddmmBackward0 <- " in out and " MB  ClippedLossBackward <- " in out


def test_peak_refuses_a_device_other_than_the_cpu_with_what_to_use_there():
    from profiling import peak
    with pytest.raises(SystemExit, match="reads CPU tensors.*_record_memory_history"):
        peak.main(TINY + ["--device", "cuda"])


def test_a_steady_peak_is_read_after_a_profiled_step():
    """torch.profiler misreads a step that frees a tensor allocated outside any profiled step (a training step's
    p.grad of the step before, freed by zero_grad): bench.steady_and_proof_peaks profiles the step before."""
    import torch
    mib = dict(size=(2 ** 18,), dtype=torch.float32)

    def mibs(n):
        return torch.ones(n, *mib["size"], dtype=mib["dtype"])

    state = {"grad": mibs(10)}

    def step():
        state["grad"] = None  # 10 MiB freed: the step starts 10 MiB below what was alive before it
        activations = mibs(20)
        new = mibs(10) + activations[:10]  # 20 + 10 + 10 alive at once
        del activations
        state["grad"] = new

    assert bench.steady_and_proof_peaks(step) == (pytest.approx(30.0, abs=0.01), None)


def test_bench_reads_tensor_bytes_on_cpu_and_runs_reentrant_checkpointing_when_asked(tmp_path, capsys):
    args = bench.parse(TINY + ["--out", str(tmp_path), "--cpu-memory", "tensors", "--steps", "2", "--warmup", "1",
                               "--checkpointing", "reentrant"])
    assert bench.parse(TINY + ["--checkpointing"]).checkpointing == "non-reentrant"
    ghost = bench.run_fresh(args, "ghost", 2)  # the options reach the fresh process
    assert "error" not in ghost, ghost
    assert 0 < ghost["peak_mb"] < 5  # a tiny model's step: its tensors, not the process's heap (RSS: ~100 MB)
    assert 0 < ghost["proof_peak_mb"] < 5  # a step its schedule proves again (bench.steady_and_proof_peaks)
    plain = {"median_ms": 1.0, "peak_mb": 1.0, "proof_peak_mb": None}  # plain has no proofs
    bench.print_table({"plain": {2: plain}, "ghost": {2: ghost}}, ["plain", "ghost"], [2])
    header, plain_row, ghost_row = capsys.readouterr().out.splitlines()
    assert header.split()[-3:] == ["proof", "MB", "proof/plain"]
    assert len(ghost_row.split()) == len(plain_row.split()) + 2


def test_a_failing_mode_is_reported_not_hidden(tmp_path):
    args = bench.parse(TINY + ["--out", str(tmp_path), "--vocab", "0"])  # no model can have 0 tokens
    assert "error" in bench.run_fresh(args, "ghost", 2)


def test_bench_refuses_no_steps_after_the_warm_up(capsys):
    from profiling.bench import parse
    with pytest.raises(SystemExit):
        parse(["--steps", "1", "--warmup", "1"])
    assert "--steps (1) must exceed --warmup (1)" in capsys.readouterr().err


def test_the_budget_search_finds_the_largest_batch_that_fits(monkeypatch):
    monkeypatch.setattr(bench, "run_fresh", lambda args, mode, batch: {"median_ms": 1.0, "peak_mb": 10.0 * batch})
    found = bench.largest_batch(None, "ghost", budget_mb=1000.0, start=16)
    assert 94 <= found <= 100  # 100 fits exactly; the bisection stops within about 6%
    assert bench.largest_batch(None, "ghost", budget_mb=5.0, start=16) == 0  # not even one example fits


def test_layer_breakdown_and_gram_choice_run(capsys):
    layers.main(TINY + ["--batch", "2", "--steps", "1", "--warmup", "1", "--skip-gram", "--skip-rules"])
    args = layers.argparse.Namespace(batch=2, device="cpu", repeats=1)
    rows = layers.gram_versus_instantiate(args, grid=[(4, 8, 8), (64, 4, 4), (128, 256, 256)])
    assert [r[5] for r in rows] == ["gram", "instantiate", "gram"] == [
        "gram" if prefers_gram(T, p, d, gram_tile(2, T, "cpu")) else "instantiate" for T, d, p, *_ in rows]
    assert all(r[3] > 0 and r[4] > 0 and r[7] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "pass 1" in out and "norm rules" in out and "Linear" in out and "cost model picked" in out


def test_step_ratio_interleaves_the_modes_and_pairs_each_round_with_plain(capsys):
    rows = step_ratio.main(TINY + ["--batch", "2", "--rounds", "3", "--warmup", "1", "--modes", "ghost", "bookkeeping"])
    assert list(rows) == ["plain", "ghost", "bookkeeping"]
    assert rows["plain"][1] == 1.0 and all(ms > 0 and ratio > 0 for ms, ratio in rows.values())
    assert "median over rounds" in capsys.readouterr().out
    times = {"plain": [1.0, 2.0, 4.0], "ghost": [2.0, 3.0, 8.0]}  # per-round ratios 2, 1.5, 2
    assert step_ratio.report(times)["ghost"] == (3000.0, 2.0)


@pytest.mark.parametrize("model", ["torch-encoder", "torch-encoder-fixed"])
def test_step_ratio_runs_torchs_transformer_encoder_before_and_after_validate_fix(model, capsys):
    rows = step_ratio.main(TINY + ["--model", model, "--batch", "2", "--rounds", "1", "--warmup", "0",
                                   "--modes", "ghost", "bookkeeping", "--freeze-embeddings"])
    assert set(rows) == {"plain", "ghost", "bookkeeping"}
    built = bench.build_model(bench.parse(TINY + ["--model", model, "--freeze-embeddings"]))
    attention = built.encoder.layers[0].self_attn
    fixed = model == "torch-encoder-fixed"
    assert isinstance(attention, ghostdp.layers.MultiheadAttention if fixed else torch.nn.MultiheadAttention)
    assert (ghostdp.validate.fallback_modules(built) == {}) == fixed
    assert not built.embeddings.weight.requires_grad and not built.position_embeddings.weight.requires_grad
    with pytest.raises(ValueError, match="--checkpointing needs a transformers model"):
        bench.build_model(bench.parse(TINY + ["--model", model, "--checkpointing"]))


def test_step_ratio_runs_the_ghostdp_modes_of_another_revision_in_the_same_rounds(capsys):
    rows = step_ratio.main(TINY + ["--batch", "2", "--rounds", "2", "--warmup", "0", "--modes", "ghost", "bookkeeping",
                                   "--against", "HEAD"])
    assert set(rows) == {"plain", "ghost", "bookkeeping", "ghost@HEAD", "bookkeeping@HEAD"}
    assert all(math.isfinite(ratio) and ratio > 0 for _, ratio in rows.values())
    assert "bookkeeping@HEAD" in capsys.readouterr().out


def test_step_ratio_refuses_a_revision_it_cannot_load(monkeypatch):
    with pytest.raises(SystemExit, match="cannot read ghostdp at that revision"):
        step_ratio.main(TINY + ["--rounds", "1", "--against", "no-such-revision"])
    # A revision whose ghostdp imports itself by name would load this checkout's modules, not its own.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        source = b"from ghostdp.engine import PrivacyEngine\n"
        info = tarfile.TarInfo("ghostdp/__init__.py")
        info.size = len(source)
        tar.addfile(info, io.BytesIO(source))
    answers = iter([subprocess.CompletedProcess([], 0, stdout="abc1234\n"),
                    subprocess.CompletedProcess([], 0, stdout=buffer.getvalue())])
    monkeypatch.setattr(revision.subprocess, "run", lambda *a, **k: next(answers))
    with pytest.raises(SystemExit, match="imports itself by name"):
        revision.ghostdp_at("abc1234")


def test_step_ratio_says_when_opacus_is_missing(monkeypatch):
    monkeypatch.setattr(step_ratio, "available", lambda mode: not mode.startswith("opacus"))
    with pytest.raises(SystemExit, match="opacus is not installed"):
        step_ratio.main(TINY + ["--modes", "opacus-ghost"])


def test_overhead_benchmark_reports_ratios_ops_and_per_layer_cost_for_both_embedding_settings(tmp_path, capsys):
    from profiling import overhead
    out = tmp_path / "overhead.json"
    results = overhead.main(["--layers", "2", "--hidden", "16", "--heads", "2", "--vocab", "64", "--rounds", "2",
                             "--warmup", "1", "--json", str(out)])
    assert set(results) == {"trainable", "frozen"}
    for setting, rows in results.items():
        # The plan floors cover Linear and LayerNorm only: the model with frozen embeddings.
        planned = {"plan floor", "graph floor"} if setting == "frozen" else set()
        assert set(rows) == {"plain", "ghost", "bookkeeping", "noise floor", "two-pass floor"} | planned
        assert rows["plain"]["ratio"] == 1.0 and rows["plain"]["hooked_layers"] > 0
        assert all(r["aten_ops"] > rows["plain"]["aten_ops"] > 0 for m, r in rows.items() if m != "plain")
        # The floors add the noise, then an activation-gradient pass; ghost does both and more.
        ops = {m: r["aten_ops"] for m, r in rows.items()}
        assert ops["noise floor"] < ops["two-pass floor"] < ops["ghost"]
        assert all(math.isfinite(r["ms_per_layer"]) and r["gc_ms"] >= 0 for r in rows.values())
    assert rows["plain"]["hooked_layers"] < results["trainable"]["plain"]["hooked_layers"]  # frozen embeddings
    assert json.loads(out.read_text())["frozen"]["ghost"]["aten_ops"] == results["frozen"]["ghost"]["aten_ops"]
    assert "ms/layer" in capsys.readouterr().out


def test_the_collector_clock_counts_collections_in_the_mode_that_runs_them():
    import gc

    from profiling.collector import collector_time
    with collector_time(["plain", "ghost"]) as clock:
        clock.mode = "ghost"
        gc.collect()
        clock.mode = None
        gc.collect()  # between measured steps: counted nowhere
    assert clock.seconds["ghost"] > 0 and clock.seconds["plain"] == 0
    assert clock not in gc.callbacks


def test_overhead_benchmark_runs_another_revisions_ghostdp_in_the_same_rounds(capsys):
    from profiling import overhead
    results = overhead.main(["--layers", "1", "--hidden", "16", "--heads", "2", "--vocab", "64", "--rounds", "1",
                             "--warmup", "0", "--embeddings", "frozen", "--no-floors", "--against", "HEAD"])
    rows = results["frozen"]
    assert set(rows) == {"plain", "ghost", "bookkeeping", "ghost@HEAD", "bookkeeping@HEAD"}
    assert all(r["aten_ops"] > rows["plain"]["aten_ops"] for m, r in rows.items() if m != "plain")
    assert "bookkeeping@HEAD" in capsys.readouterr().out


def test_the_gpu_suite_runs_every_row_scaled_down_and_writes_json_and_plot(tmp_path, capsys):
    from profiling import suite
    results = suite.main(["--tiny", "--rounds", "1", "--warmup", "1", "--modes", "plain", "ghost", "bookkeeping",
                          "--out", str(tmp_path)])
    assert list(results) == [name for name, _ in suite.ROWS]
    for name, row in results.items():
        for mode in ("plain", "ghost", "bookkeeping"):
            assert "error" not in row[mode], (name, mode, row[mode])
            assert row[mode]["ms"] > 0 and row[mode]["ratio"] > 0
            assert row[mode]["mb_max"] >= row[mode]["mb"]  # the largest over the rounds, the proof steps' too
        # Counted: ghost's two backward passes dispatch more than plain's one (book-keeping, whose clipped sums
        # replace autograd's weight gradients, may dispatch fewer).
        assert row["ghost"]["aten_ops"] > row["plain"]["aten_ops"] > 0 and row["bookkeeping"]["aten_ops"] > 0, row
    saved = json.loads((tmp_path / "suite.json").read_text())
    assert saved["tiny"] and set(saved["results"]) == set(results)
    assert (tmp_path / "suite.png").stat().st_size > 0
    assert "Llama-shaped" in capsys.readouterr().out


def test_the_gpu_suite_writes_its_json_after_every_row(tmp_path, monkeypatch):
    """A suite stopped by a time limit (the device script's) keeps the rows it measured."""
    from profiling import suite
    measure_row = suite.measure_row

    def stopped_at_the_second_row(args, *rest):
        if args.batch != suite.row_settings(suite.ROWS[0][1], True, "cpu").batch or args.freeze_embeddings is False:
            raise KeyboardInterrupt("stopped")
        return measure_row(args, *rest)

    monkeypatch.setattr(suite, "measure_row", stopped_at_the_second_row)
    with pytest.raises(KeyboardInterrupt):
        suite.main(["--tiny", "--rows", "0", "1", "--rounds", "1", "--warmup", "0", "--modes", "plain", "ghost",
                    "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "suite.json").read_text())
    assert list(saved["results"]) == [suite.ROWS[0][0]] and saved["results"][suite.ROWS[0][0]]["ghost"]["ms"] > 0


def test_the_gpu_suite_runs_another_revisions_ghostdp_in_the_same_rounds(tmp_path):
    from profiling import suite
    results = suite.main(["--tiny", "--rows", "0", "--rounds", "1", "--warmup", "1", "--modes", "plain", "ghost",
                          "bookkeeping", "--against", "HEAD", "--out", str(tmp_path)])
    row = results[suite.ROWS[0][0]]
    assert set(row) == {"plain", "ghost", "bookkeeping", "ghost@HEAD", "bookkeeping@HEAD"}
    assert all("error" not in r and r["ratio"] > 0 for r in row.values()), row
    assert json.loads((tmp_path / "suite.json").read_text())["against"] == "HEAD"


def test_bench_runs_fp32_weights_under_bf16_autocast(tmp_path):
    results = bench.main(TINY + ["--batches", "2", "--steps", "2", "--warmup", "1", "--modes", "plain", "ghost",
                                 "bookkeeping", "--dtype", "amp", "--out", str(tmp_path)])
    assert all("error" not in results[mode][2] for mode in ("plain", "ghost", "bookkeeping")), results


def test_layer_breakdown_parts_add_up_to_the_step():
    args = layers.argparse.Namespace(model="bert", layers=1, hidden=32, heads=2, vocab=64, seq=8, device="cpu",
                                     freeze_embeddings=False, batch=2, steps=2, warmup=1, dtype="fp32")
    runs = layers.breakdown(args)
    for mode, t in runs.items():
        assert all(t[k] > 0 for k in ("step.forward", "step.backward", "step.optimizer")), (mode, t)
        if mode == "plain":
            continue
        norms = sum(v for k, v in t.items() if k.startswith("ghostdp.norms."))
        pass1 = t["ghostdp.pass1"]
        assert 0 < norms <= pass1 <= t["step.backward"], (mode, t)  # nested regions: parts within the whole
        if mode == "bookkeeping":
            assert t["ghostdp.clipped_sum"] <= t["step.backward"] - pass1


def test_region_timer_times_the_controllers_regions_without_a_profiler():
    # profiling.layers sets controller.region_timer (CUDA events on a GPU, the host clock here).
    import torch
    import ghostdp
    timer = layers.RegionTimer("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    controller = ghostdp.GhostClipping(model, 1.0)
    controller.region_timer = timer
    with timer("step"):
        controller.loss(model(torch.randn(3, 4)).pow(2).sum(1)).backward()
    totals = timer.totals_ms()
    assert {"step", "ghostdp.pass1", "ghostdp.norms.Linear", "ghostdp.norms.LayerNorm"} <= set(totals)
    assert totals["ghostdp.norms.Linear"] + totals["ghostdp.norms.LayerNorm"] <= totals["ghostdp.pass1"] <= totals["step"]


def test_rules_against_their_floors_run_and_report_every_time(capsys):
    args = layers.argparse.Namespace(device="cpu", dtype="fp32")
    rows = layers.rules_against_floors(args, points=[(2, 8, 16), (2, 4, 8)])
    assert len(rows) == 2 and all(len(r) == 13 and all(v > 0 for v in r[3:]) for r in rows)
    out = capsys.readouterr().out
    assert "LN rule" in out and out.count("(their ops alone)") == 2


def test_overhead_per_layer_reduces_one_layer_at_a_time_and_restores_the_budgets():
    from ghostdp.norms import batched
    from profiling import overhead
    stack, queue = batched.STACK_ELEMENTS, batched.QUEUE_ELEMENTS
    reductions = []
    reduce = batched.NormQueue.reduce
    small = ["--layers", "2", "--hidden", "16", "--heads", "2", "--vocab", "64", "--rounds", "1", "--warmup", "0",
             "--embeddings", "frozen", "--no-floors", "--modes", "plain", "ghost"]
    try:
        batched.NormQueue.reduce = lambda self, final=False: reductions.append(len(self.factors)) or reduce(self, final)
        batched_rows = overhead.main(small)["frozen"]
        batched_reductions, reductions[:] = list(reductions), []
        per_layer_rows = overhead.main(small + ["--per-layer"])["frozen"]
    finally:
        batched.NormQueue.reduce = reduce
    assert (batched.STACK_ELEMENTS, batched.QUEUE_ELEMENTS) == (stack, queue)
    # Mostly a weight and its bias (a few small layers, e.g. the pooler and classifier, still batch) against many layers.
    assert sorted(reductions)[len(reductions) // 2] <= 2 < max(batched_reductions) and len(reductions) > 2 * len(batched_reductions)
    assert per_layer_rows["ghost"]["aten_ops"] > batched_rows["ghost"]["aten_ops"]


def test_overhead_per_layer_at_b256_takes_every_layers_norm_alone():
    """--per-layer b256: the budgets of a GPU at BERT-base B=256, where not even two of a layer's Grams fit
    DeferredGrams' budget, so no Gram waits there (at b32 they all do)."""
    from ghostdp.norms import batched, deferred
    from profiling import overhead
    stack, queue = batched.STACK_ELEMENTS, batched.QUEUE_ELEMENTS
    # 32 wide: at b32 two of a layer's (B, T, T) Grams fit half the budget (T / H = 1/4 here, 1/6 at BERT-base)
    small = ["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64", "--rounds", "1", "--warmup", "0",
             "--embeddings", "frozen", "--no-floors", "--modes", "plain", "bookkeeping"]
    taken = {}
    take = deferred.DeferredGrams.take
    try:
        for batch in ("b32", "b256"):
            found = taken[batch] = []
            deferred.DeferredGrams.take = lambda self, *a, found=found: found.append(take(self, *a)) or found[-1]
            overhead.main(small + ["--per-layer", batch])
    finally:
        deferred.DeferredGrams.take = take
    assert (batched.STACK_ELEMENTS, batched.QUEUE_ELEMENTS) == (stack, queue)
    assert sum(taken["b32"]) > 10 and taken["b256"] and not any(taken["b256"])


def test_the_graph_floor_finds_every_trained_layer_with_the_input_its_forward_read():
    """layers_in_graph: each trained Linear (3-D input: its addmm's flattened (N, d) input; the pooler's and
    classifier's 2-D one) and LayerNorm call of a tiny BERT appears once, with what its forward was given, and
    its edge takes the output's gradient; a model whose trained layer has a frozen weight is refused."""
    import torch

    from profiling import overhead, plan_floor
    args = overhead.parse(["--layers", "2", "--hidden", "16", "--heads", "2", "--vocab", "64", "--freeze-embeddings"])
    model = bench.build_model(args).double().train()
    trained = plan_floor.trained_modules(model)
    seen = {}
    for m in trained:
        m.register_forward_hook(lambda m, a, out: seen.setdefault(m, (a[0], out)) and None)
    ids = torch.randint(1, args.vocab, (2, 5), generator=torch.Generator().manual_seed(0))
    losses = model(input_ids=ids).logits.pow(2).sum(1)
    found = plan_floor.layers_in_graph(losses.grad_fn, {id(m.weight): m for m in trained})
    assert sorted(map(id, (f[0] for f in found))) == sorted(map(id, trained)) and len(trained) == 2 * 8 + 2
    outputs = [seen[m][1] for m, _, _ in found]
    by_edge = torch.autograd.grad(losses.sum(), [edge for _, _, edge in found], retain_graph=True)
    by_output = torch.autograd.grad(losses.sum(), outputs)
    for (module, x, _), g_edge, g_out in zip(found, by_edge, by_output):
        assert torch.equal(x, seen[module][0].reshape(x.shape))
        assert torch.equal(g_edge, g_out.reshape(g_edge.shape))
    trained[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="trained weight"):
        plan_floor.make_plan_floor_step(model, (ids, torch.zeros(2, dtype=torch.long)), capture="graph")


def test_bench_trains_only_the_last_layer_pooler_and_classifier_in_the_fgc_set_up():
    args = bench.parse(["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "64", "--train", "last-layer"])
    trained = {n for n, p in bench.build_model(args).named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("bert.encoder.layer.1.", "bert.pooler.", "classifier.")) for n in trained)
    assert any(n.startswith("bert.encoder.layer.1.") for n in trained)
    args = bench.parse(["--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64",
                        "--train", "last-layer"])
    with pytest.raises(ValueError, match="--model bert"):
        bench.build_model(args)


@pytest.mark.parametrize("capture", ["hooks", "graph"])  # graph: its layers found in the loss's graph
@pytest.mark.parametrize("stacked", [True, False])  # False: every layer's A and G alone (--per-layer)
def test_plan_floor_writes_the_clipped_sums_book_keeping_writes(stacked, capture):
    """The plan floor bounds what a per-call plan could save only if it does book-keeping's arithmetic:
    without noise its gradients equal ghostdp book-keeping's (float64, a tiny BERT with frozen embeddings,
    two steps, C between the examples' norms so that some are clipped and some are not), its layers captured
    by forward hooks or found in the loss's autograd graph (the graph floor)."""
    import copy

    import torch

    import ghostdp
    from profiling import overhead, plan_floor
    args = overhead.parse(["--layers", "2", "--hidden", "16", "--heads", "2", "--vocab", "64", "--seq", "6",
                           "--batch", "3", "--freeze-embeddings"])
    model = bench.build_model(args).double().train()
    assert plan_floor.supports(model) and not plan_floor.supports(bench.build_model(overhead.parse([])))
    ids = torch.randint(1, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 1])
    floor_model, private = copy.deepcopy(model), copy.deepcopy(model)
    C = 0.76  # the examples' norms here: 0.756 to 0.763
    floor_step = plan_floor.make_plan_floor_step(floor_model, (ids, labels), noise_multiplier=0.0, max_grad_norm=C,
                                                 stacked=stacked, capture=capture)
    params = [p for p in private.parameters() if p.requires_grad]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=args.batch)
    engine = ghostdp.PrivacyEngine(accountant="rdp", seed=0)
    private, optimizer, criterion, _ = engine.make_private(
        module=private, optimizer=torch.optim.SGD(params, lr=1e-3), data_loader=loader,
        criterion=torch.nn.CrossEntropyLoss(), noise_multiplier=0.0, max_grad_norm=C, clipping="bookkeeping",
        poisson_sampling=False)  # the step's own batch, as the floor's
    for _ in range(2):
        floor_step()
        optimizer.zero_grad(set_to_none=True)
        criterion(private(input_ids=ids).logits, labels).backward()
        optimizer.step()
        norms = engine.controller.last_norms
        assert norms.min() < C < norms.max()
        for (name, a), b in zip(floor_model.named_parameters(), private.parameters()):
            if a.requires_grad:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13, msg=name)


def test_collector_benchmark_runs_each_setting_in_a_process_of_its_own(capsys):
    from profiling import collector
    # Four layers: a step allocates enough tracked objects in its paused part to cross the collector's threshold
    # (~0.9 collections of generation 0 a step unpaused, ~0.2 paused). With one layer both read ~2 in 30 steps, and
    # which one gets a third depends on where the window falls.
    rows = collector.main(["--modes", "bookkeeping", "--steps", "30", "--layers", "4", "--hidden", "16",
                           "--heads", "2", "--vocab", "64"])
    assert [(r["mode"], r["pause"]) for r in rows] == [("bookkeeping", "off"), ("bookkeeping", "on")]
    off, on = rows
    assert all(r["mean_ms"] > 0 and r["gc_ms"] >= 0 and len(r["collections"]) == 3 for r in rows)
    assert on["collections"][0] < off["collections"][0] / 2  # collections in the paused part collapse into one
    assert "collections per step" in capsys.readouterr().out


def test_compiled_benchmark_runs_each_mode_eager_and_compiled_in_processes_of_their_own(capsys):
    """profiling.compiled, scaled down (dynamo's eager backend: no C++ compiler, seconds): a compiled private step
    breaks its graph at ghostdp's hooks; a plain one does not."""
    from profiling import compiled
    rows = compiled.main(["--modes", "plain", "bookkeeping", "--backends", "eager", "--steps", "3", "--warmup", "2",
                          "--layers", "1", "--hidden", "16", "--heads", "2", "--vocab", "64"])
    assert [(r["mode"], r["backend"]) for r in rows] == [("plain", "none"), ("plain", "eager"),
                                                         ("bookkeeping", "none"), ("bookkeeping", "eager")]
    assert all(r["median_ms"] > 0 for r in rows)
    breaks = {(r["mode"], r["backend"]): r["graph_breaks"] for r in rows}
    assert breaks[("plain", "eager")] == 0 and breaks[("bookkeeping", "eager")] > 0
    assert "graph breaks" in capsys.readouterr().out


def test_forward_check_margins_run_and_the_mixing_model_is_found(capsys):
    """profiling.forward_check, scaled down: a model that keeps its examples apart passes its checked forward (with
    its only padded example replaced, which makes the mask all ones), a mean over the padding and a detached batch
    mean are found."""
    from profiling import forward_check
    rows = forward_check.main(["--dtypes", "float32", "--models", "bert (sdpa)", "bert, mean over padding",
                               "detached batch mean", "--batches", "8", "16"])
    bert, padding_dependent, mixing = rows
    assert padding_dependent["padding_found"]
    assert padding_dependent["padding_move"] > padding_dependent["padding_threshold"]
    assert bert["model"] == "bert (sdpa)" and not bert["found"] and bert["move"] <= bert["threshold"]
    assert not bert["padding_found"] and 0 < bert["padding_threshold"]
    assert bert["padding_move"] <= bert["padding_threshold"]
    assert not bert["removal_found"] and 0 < bert["removal_threshold"]
    assert bert["removal_move"] <= bert["removal_threshold"]
    assert mixing["largest_batch_found"] == 16
    assert "largest relative move" in capsys.readouterr().out


def test_the_device_checks_script_dry_run_writes_each_steps_output_and_status(tmp_path):
    """profiling/device_checks.sh, with DEVICE=cpu: every step scaled down, so that the script a GPU session runs
    as one command cannot rot between the sessions lent a GPU. The suite's first row only, through SUITE_ARGS
    (test_the_gpu_suite_runs_every_row_scaled_down... runs them all)."""
    import os
    import sys
    env = dict(os.environ, DEVICE="cpu", OUT=str(tmp_path), PYTHON=sys.executable, SUITE_ARGS="--rows 0")
    steps = ("suite", "forward_check", "pass_two", "compiled", "layers", "knobs", "one_backward", "audit")
    subprocess.run(["bash", "profiling/device_checks.sh", *steps], env=env, check=True, timeout=600)
    for name in steps:
        assert f"[{name}: exit 0 after" in (tmp_path / f"{name}.txt").read_text()
    assert json.loads((tmp_path / "suite" / "suite.json").read_text())
    assert (tmp_path / "suite" / "suite.png").stat().st_size > 0
    unknown = subprocess.run(["bash", "profiling/device_checks.sh", "suit"], env=env, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown step 'suit'" in unknown.stderr


def test_knobs_runs_each_budget_variant_beside_the_shipped_settings_and_restores_them():
    from ghostdp.norms import batched, deferred
    from profiling import knobs
    shipped = (deferred._deferred_budget, dict(batched.STACK_ELEMENTS), batched.ACCELERATOR_STACK_ELEMENTS,
               batched.QUEUE_ELEMENTS)
    results = knobs.main(["--tiny", "--rounds", "1", "--warmup", "0", "--modes", "bookkeeping",
                          "--knobs", "deferred=4", "stack=0.01", "queue=2"])
    assert list(results) == ["plain", "bookkeeping", "bookkeeping deferred x4", "bookkeeping stack x0.01",
                             "bookkeeping queue x2"]
    assert all(r["ratio"] > 0 and r["aten_ops"] > 0 for r in results.values())
    # A stack budget too small for any two layers reduces each alone: more ops than the shipped stacks.
    assert results["bookkeeping stack x0.01"]["aten_ops"] > results["bookkeeping"]["aten_ops"]
    assert (deferred._deferred_budget, batched.STACK_ELEMENTS, batched.ACCELERATOR_STACK_ELEMENTS,
            batched.QUEUE_ELEMENTS) == shipped
    with pytest.raises(ValueError, match="unknown knob 'tile'"):
        knobs.parse_knobs(["tile=2"])
    with pytest.raises(ValueError, match="NAME=FACTOR"):
        knobs.parse_knobs(["deferred"])


def test_one_backward_weighs_kept_against_saved_bytes_and_switches_only_where_the_peak_is_not_higher(capsys):
    from profiling import one_backward
    rows = dict(one_backward.main(["--model", "gpt2-lm", "--layers", "1", "--hidden", "16", "--vocab", "512",
                                   "--seq", "16", "--batch", "4"]))
    rows.update(one_backward.main(["--model", "linear", "--layers", "2", "--hidden", "32", "--seq", "4",
                                   "--batch", "8"]))
    lm, stack = rows["gpt2-lm L=1 H=16 V=512 T=16 B=4 fp32"], rows["linear L=2 H=32 T=4 B=8 fp32"]
    assert lm["mode"] == "bookkeeping" and lm["kept / saved"] < 0.9
    assert lm["ghost"] == lm["book-keeping"] <= lm["two passes"]
    assert stack["mode"] == "ghost" and stack["kept / saved"] > 1
    # One step's exact tensor bytes vary by process where malloc reuses addresses (bench.tensor_peak_mb): two passes'
    # steps in two models read 0.0251 and 0.0212 MB in one CI-like run (2026-11-27), so the same mode is compared
    # within a fifth, book-keeping's higher peak strictly.
    assert stack["ghost"] == pytest.approx(stack["two passes"], rel=0.2)
    assert max(stack["ghost"], stack["two passes"]) < stack["book-keeping"]
    assert "kept/saved" in capsys.readouterr().out


def test_the_peft_methods_benchmark_interleaves_each_methods_modes_with_no_fallback(capsys):
    from profiling import peft_methods
    results = peft_methods.main(["--methods", "loha", "prompt", "conv-lokr", "--rounds", "1", "--warmup", "0"])
    assert list(results) == ["loha", "prompt", "conv-lokr"]
    for result in results.values():
        assert set(result["rows"]) == {"plain", "bookkeeping", "ghost"}
        assert result["rows"]["plain"][1] == 1.0
        assert all(math.isfinite(ratio) and ratio > 0 for _, ratio in result["rows"].values())
        assert result["fallback"] == []  # each by its rule since 2026-12-03
    assert "conv-lokr" in capsys.readouterr().out


def test_the_families_benchmark_interleaves_each_familys_modes_and_lists_its_fallback_modules(capsys):
    from profiling import families
    results = families.main(["--families", "convnext", "t5", "--rounds", "1", "--warmup", "0", "--against", "HEAD"])
    assert list(results) == ["convnext", "t5"]
    for result in results.values():
        assert set(result["rows"]) == {"plain", "bookkeeping", "ghost", "bookkeeping@HEAD", "ghost@HEAD"}
        assert result["rows"]["plain"][1] == 1.0
        assert all(math.isfinite(ratio) and ratio > 0 for _, ratio in result["rows"].values())
    # Neither has a module on the fallback left: T5's relative attention bias is looked up per example since
    # 2026-11-28 (norms/relative_bias.py), ConvNext's blocks' layer scales have their rule since 2026-11-27.
    assert results["t5"]["fallback"] == [] and results["convnext"]["fallback"] == []
    assert "ghost@HEAD" in capsys.readouterr().out
    torch_layers = families.main(["--families", "embedding-bag", "instance-norm", "conv-transpose", "--rounds", "1",
                                  "--warmup", "0"])
    # by their rules since 2026-11-27 (transposed convolutions: 2026-11-28)
    assert all(result["fallback"] == [] for result in torch_layers.values())
    # WavLM, Swin v2, DeBERTa-v3's attention and MPNet's bias train once validate.fix has swapped in their twins
    # (ghostdp.layers.twins; refused before 2026-12-02)
    twinned = families.main(["--families", "wavlm", "swinv2", "deberta-v3", "mpnet", "--rounds", "1", "--warmup", "0"])
    ratios = [ratio for result in twinned.values() for _, ratio in result["rows"].values()]
    assert len(ratios) == 12 and all(math.isfinite(ratio) and ratio > 0 for ratio in ratios)

"""Automatic pipeline partitioning: the dynamic program against brute force (exact optimum on random small
instances, with memory limits, schedules' in-flight counts and transfer costs), uneven costs, infeasible
limits explained, the profiler's byte counts, the GPT as a chain of layers, and auto_partition end to end
(predicted vs measured stage times, cuts that split_model accepts)."""

import itertools
import math
import random
import re
import time

import pytest
import torch
from torch import nn

from plait.errors import LayoutError
from plait.models import GPT, GPTConfig
from plait.parallel.pipeline.split import split_model
from plait.planner.partition import Partition, auto_partition, partition
from plait.planner.profile import LayerChain, gpt_layers, measure_stages, profile_layers


# ---------------------------------------------------------------------------------------- the DP vs brute force
def brute_force(times, memory, p, limit, acts, flight, comm, overlaps):
    """The best bottleneck over every split into p non-empty contiguous stages (None if none fits)."""
    n, best = len(times), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        stages, fits = [], True
        for k, (i, j) in enumerate(zip(bounds, bounds[1:])):
            t = sum(times[i:j])
            if not overlaps:
                t += (comm[i - 1] if i > 0 else 0) + (comm[j - 1] if j < n else 0)
            fits &= sum(memory[i:j]) + flight[k] * sum(acts[i:j]) <= limit
            stages.append(t)
        links = [comm[c - 1] for c in cuts] if overlaps else []
        if fits:
            value = max(stages + links)
            best = value if best is None else min(best, value)
    return best


def smallest_limit(memory, p, acts, flight):
    n = len(memory)
    return min(
        max(sum(memory[i:j]) + flight[k] * sum(acts[i:j]) for k, (i, j) in enumerate(zip(b, b[1:])))
        for b in ([0, *c, n] for c in itertools.combinations(range(1, n), p - 1))
    )


def test_dp_matches_brute_force_on_random_instances():
    rng = random.Random(0)
    checked = infeasible = stated_limits = 0
    for _ in range(400):
        n = rng.randint(1, 8)
        p = rng.randint(1, min(n, 4))
        times = [rng.randint(0, 9) for _ in range(n)]  # integers: sums are exact, so optima compare with ==
        memory = [rng.randint(0, 9) for _ in range(n)]
        acts = [rng.randint(0, 3) for _ in range(n)]
        flight = [rng.randint(0, p) for _ in range(p)]
        comm = [rng.randint(0, 15) for _ in range(n - 1)]  # large enough to decide some splits
        overlaps = rng.random() < 0.5
        limit = rng.choice([None, rng.randint(5, 40)])
        want = brute_force(times, memory, p, limit if limit is not None else float("inf"), acts, flight, comm, overlaps)
        kwargs = dict(activations=acts, in_flight=flight, comm=comm, comm_overlaps=overlaps)
        if want is None:
            with pytest.raises(LayoutError) as error:
                partition(times, memory, p, limit, **kwargs)
            needed = smallest_limit(memory, p, acts, flight)
            stated = re.search(r"\((\d+) bytes, cuts=|alone needs (\d+) B", str(error.value))
            if stated and stated.group(1):  # "the smallest limit any split meets is ..." is exact
                assert int(stated.group(1)) == needed
                partition(times, memory, p, needed, **kwargs)  # and it is feasible
                stated_limits += 1
            infeasible += 1
            continue
        result = partition(times, memory, p, limit, **kwargs)
        assert result.bottleneck == want
        assert len(result.cuts) == p - 1 and result.bounds[0] == 0 and result.bounds[-1] == n
        assert all(a < b for a, b in zip(result.bounds, result.bounds[1:]))
        if limit is not None:
            assert max(result.stage_memory) <= limit
        checked += 1
    assert checked > 200 and infeasible > 10 and stated_limits > 5  # every branch was exercised


def test_one_heavy_layer_gets_a_stage_of_its_own():
    times = [1, 1, 1, 10, 1, 1, 1, 1]
    result = partition(times, [0] * 8, 3)
    assert result.bottleneck == 10
    assert (3, 4) in list(zip(result.bounds, result.bounds[1:]))  # layer 3 alone: any neighbour would add time
    even = max(sum(times[0:3]), sum(times[3:6]), sum(times[6:8]))  # an even split in layers: 12
    assert result.bottleneck < even


def test_even_costs_split_evenly():
    result = partition([2.0] * 12, [1.0] * 12, 4)
    assert result.cuts == [3, 6, 9] and result.stage_times == (6.0,) * 4 and result.balance == 1.0


def test_memory_limit_moves_the_cuts():
    # 1F1B on p=2 holds 2 micro-batches on stage 0 and 1 on stage 1: with activations of 4 per layer per
    # micro-batch, stage 0 may hold fewer layers than the time-optimal split wants.
    times, memory, acts = [1] * 6, [1] * 6, [4] * 6
    free = partition(times, memory, 2, activations=acts, in_flight=[2, 1])
    assert free.cuts == [3] and free.stage_memory == (27.0, 15.0)
    limited = partition(times, memory, 2, 20, activations=acts, in_flight=[2, 1])
    assert limited.cuts == [2] and limited.stage_memory == (18.0, 20.0) and limited.bottleneck == 4
    assert "memory <= 20 B per stage" in limited.summary()


def test_a_layer_too_big_alone_is_named():
    with pytest.raises(LayoutError, match=r"layer 2 \(big\) alone needs 50 B .* more than memory_limit=40 B"):
        partition([1, 1, 1, 1], [5, 5, 50, 5], 2, 40, unit_names=["a", "b", "big", "c"])


def test_infeasible_limit_names_the_smallest_feasible_one():
    with pytest.raises(LayoutError, match=r"smallest limit any split meets is 20 B \(20 bytes, cuts=\[2\]\)"):
        partition([1, 1, 1, 1], [10, 10, 10, 10], 2, 15)


def test_links_count_in_the_objective():
    # A cut after layer 0 costs 100: the best split avoids it although it balances compute better.
    result = partition([3, 1, 1, 1], [0] * 4, 2, comm=[100, 1, 1])
    assert result.cuts != [1] and result.bottleneck == max(result.stage_times + result.link_times)
    added = partition([1, 1, 1, 1], [0] * 4, 2, comm=[5, 1, 5], comm_overlaps=False)
    assert added.cuts == [2] and added.stage_times == (3.0, 3.0)  # each side pays the transfer at its cut


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(times=[1, 1], memory=[0, 0], p=3), "cannot cut 2 layers into p=3 stages"),
        (dict(times=[1, -1], memory=[0, 0], p=1), r"times\[1\] = -1.0 must be a finite number >= 0"),
        (dict(times=[1, 1], memory=[0], p=1), "memory has 1 entries, but there are 2 layers"),
        (dict(times=[1, 1], memory=[0, 0], p=0), "p=0 stages must be an integer >= 1"),
        (dict(times=[1, 1], memory=[0, 0], p=2, in_flight=[1]), "must give p=2 counts"),
    ],
)
def test_bad_input_is_refused(kwargs, words):
    with pytest.raises(LayoutError, match=words):
        partition(**kwargs)


# ---------------------------------------------------------------------------------------- profiling
def test_profile_counts_parameters_saved_activations_and_outputs():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False)]
    profiles = profile_layers(layers, torch.randn(4, 8), repeats=2, warmup=1)
    assert [pr.name for pr in profiles] == ["0", "1", "2"]
    assert [pr.param_bytes for pr in profiles] == [(8 * 16 + 16) * 4, 0, 16 * 4 * 4]
    # Linear saves its input (the weight is a parameter, excluded); ReLU saves its output (4 x 16 floats).
    assert [pr.activation_bytes for pr in profiles] == [4 * 8 * 4, 4 * 16 * 4, 4 * 16 * 4]
    assert [pr.output_bytes for pr in profiles] == [4 * 16 * 4, 4 * 16 * 4, 4 * 4 * 4]
    assert all(pr.forward_s > 0 and pr.backward_s > 0 and pr.time_s == pr.forward_s + pr.backward_s for pr in profiles)
    assert all(param.grad is None for layer in layers for param in layer.parameters())  # left as found


def test_profile_rejects_a_layer_that_returns_no_tensor():
    with pytest.raises(ValueError, match="layer 0 returned tuple"):
        profile_layers([nn.LSTM(4, 4)], torch.randn(2, 3, 4), repeats=1, warmup=0)


def small_gpt(n_layer=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, seq_len=16, n_layer=n_layer, n_head=4, d_model=32))


def test_gpt_layers_run_in_sequence_equal_the_model():
    model = small_gpt()
    tokens = torch.randint(0, 32, (2, 16))
    chain = gpt_layers(model)
    assert chain.names == ("embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")
    assert chain.num_units == 4 and chain.layer_bounds([0, 1, 3, 4]) == [0, 2, 4, 6]
    hidden = tokens
    for layer in chain.modules:
        hidden = layer(hidden)
    assert torch.equal(hidden, model(tokens))  # the same modules and ops, in the same order: bitwise
    shared = {id(p) for layer in chain.modules for p in layer.parameters()}
    assert shared == {id(p) for p in model.parameters()}  # wrappers, not copies


def test_gpt_layers_needs_the_whole_model():
    model = small_gpt()
    model.lm_head = None
    with pytest.raises(LayoutError, match="lm_head is missing"):
        gpt_layers(model)


class Repeated(nn.Module):
    """A tanh(linear) applied ``times`` times: cost proportional to ``times``."""

    def __init__(self, times: int, width: int = 64) -> None:
        super().__init__()
        self.linear, self.times = nn.Linear(width, width), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.linear(x))
        return x


def test_auto_partition_isolates_the_heavy_layer_and_measures_it():
    torch.manual_seed(0)
    layers = nn.Sequential(*(Repeated(t) for t in (2, 2, 2, 24, 2, 2, 2, 2)))
    result = auto_partition(layers, torch.randn(64, 64), 3, repeats=7)
    assert isinstance(result, Partition)
    assert (3, 4) in list(zip(result.bounds, result.bounds[1:]))  # 24 units of work vs 16 for all the others
    heavy = result.bounds.index(3)
    measured = result.measured_times
    assert measured is not None and len(measured) == 3
    assert max(range(3), key=lambda k: measured[k]) == heavy, result.summary()  # measured: the slowest too
    assert "predicted" in result.summary() and "measured" in result.summary()


class _Sleep(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Sleeper(nn.Module):
    def __init__(self, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.forward_s, self.backward_s = forward_ms / 1e3, backward_ms / 1e3

    def forward(self, x):
        return _Sleep.apply(x, self.forward_s, self.backward_s)


def test_predicted_and_measured_stage_times_agree_on_sleeping_layers():
    """Sleeps make the costs independent of how busy the shared CPU is (a sleep lasts at least its time):
    forward and backward are each timed, and a stage run as one piece takes the sum of its layers."""
    layers = [Sleeper(1, 2), Sleeper(1, 2), Sleeper(1, 2), Sleeper(4, 12), Sleeper(1, 2), Sleeper(1, 2)]
    profiles = profile_layers(layers, torch.randn(4, 4), repeats=3, warmup=1)
    assert [pr.forward_s >= f for pr, f in zip(profiles, (1e-3,) * 3 + (4e-3,) + (1e-3,) * 2)] == [True] * 6
    assert all(pr.backward_s >= (12e-3 if i == 3 else 2e-3) for i, pr in enumerate(profiles))
    result = auto_partition(layers, torch.randn(4, 4), 3, repeats=3)
    assert result.cuts == [3, 4]  # 16 ms alone vs 9 and 6 ms for the others
    for predicted, measured, floor in zip(result.stage_times, result.measured_times, (9e-3, 16e-3, 6e-3)):
        assert predicted >= floor and measured >= floor
        # Above the floor, only Python/autograd overhead and late wake-ups (tens of microseconds idle; a few
        # ms when other processes load the 2 cores): 5 ms of slack.
        assert abs(measured - predicted) < 5e-3, result.summary()


def test_auto_partition_gpt_cuts_are_block_indices_for_split_model():
    model = small_gpt(n_layer=4)
    tokens = torch.randint(0, 32, (4, 16))
    result = auto_partition(gpt_layers(model), tokens, 2, repeats=3)
    assert result.unit_names[0] == "embedding+blocks.0" and result.unit_names[-1] == "blocks.3+head"
    assert len(result.cuts) == 1 and 1 <= result.cuts[0] <= 3
    stages = split_model(model, 2, result.cuts)
    assert sorted(stages[0].blocks.keys(), key=int) == [str(b) for b in range(result.cuts[0])]
    assert stages[0].tok_embed is not None and stages[1].lm_head is not None
    # Memory: 4 bytes of state per parameter byte, plus 1F1B's in-flight activations (p - k on stage k).
    profiles = profile_layers(gpt_layers(model), tokens, repeats=1, warmup=0)
    first = range(0, result.cuts[0] + 1)  # embedding + blocks before the cut, in chain indices
    want = sum(4 * profiles[i].param_bytes + 2 * profiles[i].activation_bytes for i in first)
    assert result.stage_memory[0] == want


def test_auto_partition_prices_zb_h1_s_last_stage_with_p_micro_batches_in_flight():
    """plait's I keeps the graph for W, so under ZB-H1 every stage holds p micro-batches until their W
    (tests/test_vshape_memory.py measures it): the last stage's memory counts 2 at p = 2, not 1F1B's 1."""
    model = small_gpt(n_layer=4)
    tokens = torch.randint(0, 32, (4, 16))
    chain = gpt_layers(model)
    runs = {s: auto_partition(chain, tokens, 2, schedule=s, repeats=1, measure=False) for s in ("1f1b", "zero-bubble")}
    profiles = profile_layers(chain, tokens, repeats=1, warmup=0)
    for schedule, held in (("1f1b", 1), ("zero-bubble", 2)):
        last = range(runs[schedule].cuts[0] + 1, len(profiles))  # chain index 0 is the embedding + block 0
        want = sum(4 * profiles[i].param_bytes + held * profiles[i].activation_bytes for i in last)
        assert runs[schedule].stage_memory[1] == want, schedule


def test_measure_stages_runs_each_piece():
    layers = LayerChain((Repeated(1), Repeated(1), Repeated(1)), ("a", "b", "c"))
    times = measure_stages(layers, torch.randn(8, 64), [0, 1, 3], repeats=2, warmup=1)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_auto_partition_memory_limit_too_small_is_explained():
    model = small_gpt(n_layer=2)
    with pytest.raises(LayoutError, match="alone needs"):
        auto_partition(gpt_layers(model), torch.randint(0, 32, (2, 16)), 2, memory_limit=1000, repeats=1, measure=False)


def test_auto_partition_given_a_count_instead_of_a_micro_batch_says_so_in_one_line():
    """docs/pipeline.md once named the argument ``tokens_of_one_microbatch``: an int there was a raw traceback."""
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match=r"sample_input must be one micro-batch .* got int 512\. Fix: pass e\.g\."):
        auto_partition(gpt_layers(small_gpt(n_layer=2)), 512, 2, repeats=1, measure=False)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- the one DP core
def test_the_chain_dp_core_matches_brute_force_for_max_and_sum():
    """``inter_op.split_chain`` is the one dynamic program behind PipeDream's partitioner (max of stage costs, cost
    depending on the stage's index: in-flight memory) and Alpa's inter-op pass (sum over stages on sub-meshes of
    several sizes using every device): checked against every split on random small chains."""
    import numpy as np

    from plait.planner import inter_op
    from plait.planner import partition as partition_module
    from plait.planner.inter_op import split_chain

    assert partition_module.split_chain is inter_op.split_chain  # partition.py calls the same core
    rng = random.Random(5)
    for _ in range(150):
        n, budget = rng.randint(1, 6), rng.randint(1, 5)
        sizes = sorted(rng.sample([1, 2, 3], rng.randint(1, 2)))
        table = {
            (d, s): np.array([[rng.choice([rng.randint(0, 9), math.inf]) for _ in range(n + 1)] for _ in range(n + 1)])
            for d in range(budget + 1)
            for s in sizes
        }
        for combine in ("max", "sum"):
            best = math.inf
            for k in range(1, n + 1):
                for cuts in itertools.combinations(range(1, n), k - 1):
                    bounds = list(zip((0, *cuts), (*cuts, n)))
                    for units in itertools.product(sizes, repeat=k):
                        if sum(units) != budget:
                            continue
                        used, values = 0, []
                        for (i, j), s in zip(bounds, units):
                            values.append(table[(used, s)][i, j])
                            used += s
                        best = min(best, max(values) if combine == "max" else sum(values))
            found = split_chain(n, budget, sizes, lambda d, s: table[(d, s)], combine)  # noqa: B023
            if math.isinf(best):
                assert found is None
                continue
            value, stages = found
            assert value == best and sum(s for *_, s in stages) == budget
            assert stages[0][0] == 0 and stages[-1][1] == n and all(a < b for a, b, _ in stages)

"""``tensile_db.runtime.search``: which trials a ``search`` option asks for, and when halving
stops one.

The grid's size and order, its seeded sampling, random draws (deterministic per seed, values from
the lists), the refusals with their messages, how a trial's values enter its options and
architecture, the rungs of several epoch counts and sequences of :class:`Halving` decisions worked
by hand.
"""

from __future__ import annotations

import itertools

import pytest

from tensile_db.errors import InvalidArgument
from tensile_db.runtime import search
from tensile_db.runtime.model import parse_options
from tensile_db.runtime.search import Halving, combinations, parse, rungs, trial_inputs

LR = [0.001, 0.01, 0.1]
BATCH = [16, 64]
OPTIMIZERS = ["sgd", "adam"]


def test_defaults():
    s = parse({"params": {"lr": LR}})
    assert (s.method, s.trials, s.parallel, s.halving) == ("grid", None, 4, False)
    assert s.params == (("lr", tuple(LR)),)


def test_grid_is_every_combination_last_parameter_fastest():
    s = parse({"method": "grid", "params": {"lr": LR, "batch_size": BATCH, "optimizer": OPTIMIZERS}})
    grid = combinations(s, seed=0)
    assert len(grid) == 12
    assert grid == [{"lr": a, "batch_size": b, "optimizer": c} for a, b, c in itertools.product(LR, BATCH, OPTIMIZERS)]
    assert grid[:3] == [{"lr": 0.001, "batch_size": 16, "optimizer": "sgd"},
                        {"lr": 0.001, "batch_size": 16, "optimizer": "adam"},
                        {"lr": 0.001, "batch_size": 64, "optimizer": "sgd"}]
    assert combinations(s, seed=99) == grid                       # a whole grid does not depend on the seed


def test_grid_sampled_by_trials():
    s = parse({"params": {"lr": LR, "batch_size": BATCH, "optimizer": OPTIMIZERS}, "trials": 5})
    grid = combinations(parse({"params": {"lr": LR, "batch_size": BATCH, "optimizer": OPTIMIZERS}}), 0)
    sample = combinations(s, seed=3)
    assert len(sample) == 5
    positions = [grid.index(c) for c in sample]
    assert positions == sorted(set(positions))                   # distinct, in grid order
    assert combinations(s, seed=3) == sample
    assert any(combinations(s, seed=k) != sample for k in range(4, 10))
    # trials beyond the grid: the grid itself
    assert combinations(parse({"params": {"lr": LR}, "trials": 10}), seed=3) == [{"lr": v} for v in LR]


def test_random_draws_are_seeded_and_come_from_the_lists():
    s = parse({"method": "random", "params": {"lr": LR, "momentum": [0.0, 0.5, 0.9]}, "trials": 20})
    draws = combinations(s, seed=7)
    assert len(draws) == 20
    assert all(set(d) == {"lr", "momentum"} and d["lr"] in LR and d["momentum"] in (0.0, 0.5, 0.9) for d in draws)
    assert combinations(s, seed=7) == draws
    assert combinations(s, seed=8) != draws
    assert {d["lr"] for d in draws} == set(LR)                    # 20 draws of 3 values reach every one
    assert len(combinations(parse({"method": "random", "params": {"lr": LR}}), seed=0)) == 8


def test_random_may_ask_for_more_trials_than_the_grid_holds():
    s = parse({"method": "random", "params": {"lr": [0.1]}, "trials": 3})
    assert combinations(s, seed=0) == [{"lr": 0.1}] * 3


@pytest.mark.parametrize("value, message", [
    ([], 'options.search must be an object such as {"method": "grid", "params": {"lr": [0.001, 0.01]}}, got []'),
    ({"params": {"lr": LR}, "budget": 3}, "options.search: unknown key 'budget'; allowed keys: method, params, "
                                          "trials, parallel, halving"),
    ({"method": "bayes", "params": {"lr": LR}}, 'options.search.method must be one of grid, random, got "bayes"'),
    ({"params": {}}, 'options.search.params must be a non-empty object of lists, such as {"lr": [0.001, 0.01], '
                     '"batch_size": [32, 128]}, got {}'),
    ({"params": {"dropout": [0.1]}}, "options.search.params: unknown parameter 'dropout'; a search may vary lr, "
                                     "batch_size, epochs, optimizer, momentum, weight_decay, seed, layers"),
    ({"params": {"lr": 0.1}}, 'options.search.params."lr" must be a list of 1 to 64 values, got 0.1'),
    ({"params": {"lr": []}}, 'options.search.params."lr" must be a list of 1 to 64 values, got []'),
    ({"params": {"lr": list(range(1, 66))}}, 'options.search.params."lr" must be a list of 1 to 64 values, got '
                                             '[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1...'),
    ({"params": {"lr": LR}, "trials": 65}, "options.search.trials must be an integer from 1 to 64, got 65"),
    ({"params": {"lr": LR}, "trials": True}, "options.search.trials must be an integer from 1 to 64, got true"),
    ({"params": {"lr": LR}, "trials": 2.0}, "options.search.trials must be an integer from 1 to 64, got 2.0"),
    ({"params": {"lr": list(range(1, 11)), "batch_size": list(range(1, 8))}},
     'options.search asks for a grid of 70 trials, more than 64; list fewer values, or sample the grid with '
     '"trials": N'),
    ({"params": {"lr": LR}, "parallel": 0}, "options.search.parallel must be an integer from 1 to 64, got 0"),
    ({"params": {"lr": LR}, "parallel": "2"}, 'options.search.parallel must be an integer from 1 to 64, got "2"'),
    ({"params": {"lr": LR}, "halving": "yes"}, 'options.search.halving must be true or false, got "yes"'),
])
def test_refusals(value, message):
    with pytest.raises(InvalidArgument) as info:
        parse(value)
    assert str(info.value) == message


def test_a_large_grid_may_be_sampled_and_random_ignores_the_grid_size():
    params = {"lr": list(range(1, 11)), "batch_size": list(range(1, 8))}
    assert len(combinations(parse({"params": params, "trials": 64}), seed=0)) == 64
    assert len(combinations(parse({"method": "random", "params": params}), seed=0)) == 8


def test_parse_options_validates_the_search():
    assert parse_options({"search": {"params": {"lr": LR}}}).search == {"params": {"lr": LR}}
    with pytest.raises(InvalidArgument, match="unknown parameter 'dropout'"):
        parse_options({"search": {"params": {"dropout": [0.1]}}})


def test_trial_inputs_put_the_values_in():
    architecture = {"layers": [{"dense": 8}]}
    options = {"epochs": 5, "lr": 0.5, "seed": 1, "search": {"params": {"lr": LR}}}
    arch, opts = trial_inputs({"lr": 0.01, "batch_size": 64, "layers": [{"dense": 32}, {"dense": 16}]},
                              architecture, options)
    assert arch == {"layers": [{"dense": 32}, {"dense": 16}]}
    assert opts == {"epochs": 5, "lr": 0.01, "seed": 1, "batch_size": 64}
    assert architecture == {"layers": [{"dense": 8}]} and "search" in options    # the call's are not changed
    parsed = parse_options(opts)                                 # a trial's options are plain options
    assert (parsed.lr, parsed.batch_size, parsed.search) == (0.01, 64, None)
    same, _ = trial_inputs({"lr": 0.1}, architecture, options)
    assert same == architecture


def test_trial_inputs_refuse_layers_for_a_named_network():
    with pytest.raises(InvalidArgument) as info:
        trial_inputs({"layers": [{"dense": 4}]}, {"model": "resnet18"}, {})
    assert str(info.value) == ('options.search.params.layers replaces the architecture\'s layers, but the '
                               'architecture names the network "resnet18"; vary other parameters')
    arch, opts = trial_inputs({"lr": 0.1}, {"model": "resnet18"}, {"search": {}})
    assert arch == {"model": "resnet18"} and opts == {"lr": 0.1}


@pytest.mark.parametrize("epochs, expected", [
    (1, []), (2, [1]), (3, [1]), (4, [1, 2]), (7, [1, 3]), (8, [1, 2, 4]), (10, [1, 2, 5]), (16, [2, 4, 8]),
    (100, [12, 25, 50]),
])
def test_rungs(epochs, expected):
    assert rungs(epochs) == expected


def test_halving_keeps_the_better_half_at_each_rung():
    h = Halving(8)                                               # rungs 1, 2, 4
    assert h.rungs == [1, 2, 4]
    # rung 1: 0.5 alone is kept; 0.7 is worse than half of [0.5, 0.7]; 0.3 is the best; 0.6 has
    # two better of four (not fewer than 2); 0.4 has two better of five (fewer than 3)
    assert [h.keeps(1, v) for v in (0.5, 0.7, 0.3, 0.6, 0.4)] == [True, False, True, False, True]
    assert h.losses[1] == [0.5, 0.7, 0.3, 0.6, 0.4]
    # rung 2 has its own losses; a tie is not better, so an equal loss is kept
    assert [h.keeps(2, v) for v in (1.0, 1.0, 2.0, 0.5)] == [True, True, False, True]
    # epochs that are no rung always keep, and record nothing
    assert all(h.keeps(e, 99.0) for e in (3, 5, 8, 9))
    assert h.losses[4] == [] and set(h.losses) == {1, 2, 4}


def test_halving_without_rungs_keeps_everything():
    h = Halving(1)
    assert h.rungs == [] and all(h.keeps(1, v) for v in (3.0, 1.0, 2.0))


def test_module_constants():
    assert search.MAX_TRIALS == 64 and set(search.PARAMS) == set(search.OPTION_PARAMS) | {"layers"}


def test_halving_needs_held_out_rows():
    opts = {"search": {"params": {"lr": [0.1, 0.01]}, "halving": True}}
    assert parse_options(opts).search["halving"]
    with pytest.raises(InvalidArgument) as info:
        parse_options(dict(opts, test_size=0))
    assert str(info.value) == ("options.search.halving compares held-out losses, but options.test_size is 0; hold out "
                               "rows (test_size 0.2) or leave halving out")


def test_the_trials_weights_together_stay_within_max_job_bytes():
    from tensile_db.pg.search import plan
    from tensile_db.runtime.model import Limits, ModelSpec, parse_architecture

    arch = parse_architecture({"layers": [{"dense": 256}]})
    opts = parse_options({"search": {"params": {"lr": [0.1, 0.01, 0.001, 0.0001]}}})
    found, trials = plan(arch, opts, Limits(), 64, 10, "classification", "m")
    one = 4 * (64 * 256 + 256 + 256 * 10 + 10)              # float32 weights of one trial
    assert len(trials) == 4
    assert search.weights_nbytes(ModelSpec.parse(trials[0].architecture, 64, 10, "classification")) == one
    plan(arch, opts, Limits(max_job_nbytes=4 * one), 64, 10, "classification", "m")
    with pytest.raises(InvalidArgument) as info:
        plan(arch, opts, Limits(max_job_nbytes=4 * one - 1), 64, 10, "classification", "m")
    assert str(info.value) == (f"the 4 trials of the search hold {4 * one:,} bytes of weights together, more than "
                               f"tensile.max_job_bytes ({4 * one - 1:,}); search fewer trials or smaller layers, or "
                               "ask the administrator to raise tensile.max_job_bytes")

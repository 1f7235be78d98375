"""The host memory of sharded commits, over real FSDP2 on a gloo group of two ranks: a commit's
own copy and its received buddy copy land in memory that commits dropped earlier, never in
memory a kept commit still holds, and a rollback restores a commit made in recycled memory
exactly; a formation's tensor specs are read once, not at every commit; a reshard writes the
new objects in place and their commit's own copy, taken on a thread, is the formation's state,
not the first step's."""

from __future__ import annotations

from datetime import timedelta

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from elastic.foundation.events import EventLog
from elastic.sharded import ShardedRuntime
from elastic.state import TrainState
from tests.support.gloo_group import run_in_group
from tests.support.sharded_runtime import (TIMEOUT, commit_shards, form, hold_back_copies,
                                           round_of)

COMMITS = 6


def _parallelize(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)).double()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.05)}


def _train_step(runtime: ShardedRuntime, seed: int) -> None:
    model, optimizer = runtime.objects["model"], runtime.objects["optimizer"]
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _storages(tensors: dict[str, torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}


def _kept(runtime: ShardedRuntime) -> list:
    return list(runtime._commits._commits)


def _commits_in_recycled_memory(rank: int, world: int) -> dict:
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    train = TrainState(step=0)
    train.commit()
    form(runtime, train, rank, world, 1)
    seen = []  # (own copy, received copy) of every commit; held so that no address repeats
    specs = []  # every commit's tensor specs, held alike
    bytes_of = {}  # (version, shard) -> a clone of what the commit held there
    changed = []  # kept commits whose bytes changed after a later commit
    shared = []  # received copies that landed in a kept commit's memory
    for number in range(COMMITS):
        _train_step(runtime, number)
        commit_shards(runtime, train)
        runtime.before_commit()  # this commit's buddy copy has landed
        kept = _kept(runtime)
        newest = kept[-1]
        seen.append((newest.held[newest.own], newest.held[1 - newest.own]))
        specs.append(newest.specs)
        others = set().union(*(_storages(s) for c in kept[:-1] for s in c.held.values()))
        if _storages(newest.held[1 - newest.own]) & others:
            shared.append(newest.version)
        for commit in kept:
            for shard, tensors in commit.held.items():
                clone = {n: t.clone() for n, t in tensors.items()}
                before = bytes_of.setdefault((commit.version, shard), clone)
                if not all(torch.equal(before[n], clone[n]) for n in clone):
                    changed.append((commit.version, shard))
    newest = _kept(runtime)[-1]
    _train_step(runtime, 99)  # a step that the rollback undoes
    runtime.settle()
    form(runtime, train, rank, world, 2)
    model, optimizer = runtime.objects["model"], runtime.objects["optimizer"]
    from elastic.state.sharded.shards import flat_tensors, local_part, sharded_state_dict

    live = flat_tensors(*sharded_state_dict(model, optimizer))
    restored = all(torch.equal(local_part(v), bytes_of[(newest.version, newest.own)][n])
                   for n, v in live.items())
    own, received = zip(*seen)
    return {"changed": changed, "shared": shared, "restored": restored,
            "specs_read": len({id(s) for s in specs}),
            "rolled_back_to": train.version == newest.version,
            "own_new": [bool(_storages(s) - set().union(*map(_storages, own[:i])))
                        for i, s in enumerate(own)],
            "received_new": [bool(_storages(s) - set().union(*map(_storages, received[:i])))
                             for i, s in enumerate(received)]}


def test_sharded_commits_reuse_dropped_memory_and_never_touch_a_kept_commit(tmp_path):
    results = run_in_group(_commits_in_recycled_memory, 2, tmp_path)
    for result in results.values():
        assert result["changed"] == [] and result["shared"] == []
        assert result["restored"] and result["rolled_back_to"] and result["specs_read"] == 1
        # the first commits need new memory; from the fourth on, the memory of dropped ones
        assert result["own_new"][3:] == [False] * (COMMITS - 3), result["own_new"]
        assert result["received_new"][3:] == [False] * (COMMITS - 3), result["received_new"]


def _one_step_committed(rank: int, world: int) -> tuple[ShardedRuntime, TrainState]:
    """A formation of round 1, one step, and its commit with the buddy copies landed."""
    runtime = ShardedRuntime(_parallelize, None, 1, TIMEOUT, timedelta(seconds=2))
    train = TrainState(step=0)
    train.commit()
    form(runtime, train, rank, world, 1)
    _train_step(runtime, 0)
    commit_shards(runtime, train)
    runtime.before_commit()
    return runtime, train


def _live_commit_checks(rank: int, world: int) -> dict:
    runtime, train = _one_step_committed(rank, world)
    after_steps = []
    for seed in (1, 2):  # steps apply in place: the tensors recorded stay the live ones
        _train_step(runtime, seed)
        after_steps.append(runtime.can_commit_live())
    optimizer = runtime.objects["optimizer"]
    saved = optimizer.state_dict()  # the user loads a copy: new state tensors, same values
    saved["state"] = {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in entry.items()}
                      for k, entry in saved["state"].items()}
    optimizer.load_state_dict(saved)
    replaced = runtime.can_commit_live()
    commit_shards(runtime, train)  # the next commit records the new ones
    runtime.before_commit()
    recorded_again = runtime.can_commit_live()
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    _train_step(runtime, 3)  # the new group's parameter has no gradient: no state yet
    runtime.objects["model"].zero_grad()
    extra = optimizer.param_groups[-1]["params"][0]
    extra.grad = torch.ones_like(extra)
    optimizer.step()  # its state is new since the last commit
    new_state = runtime.can_commit_live()
    return {"after_steps": after_steps, "replaced": replaced,
            "recorded_again": recorded_again, "new_state": new_state}


def test_the_live_shards_serve_as_a_commit_only_while_they_are_the_tensors_last_recorded(
        tmp_path):
    for result in run_in_group(_live_commit_checks, 2, tmp_path).values():
        assert result == {"after_steps": [True, True], "replaced": False,
                          "recorded_again": True, "new_state": False}


def _own_copy_after_an_in_place_reshard(rank: int, world: int) -> dict:
    runtime, train = _one_step_committed(rank, world)
    runtime.settle()
    # the formation's own copy is held back until the first step either waits for it (the
    # hook) or, if nothing held it, has ended
    go = hold_back_copies(runtime)
    events = EventLog(None, f"rank{rank}")
    resharded: list[dict] = []
    events.listen(lambda e: resharded.append(dict(e)) if e["event"] == "resharded" else None)
    topology, group = round_of(rank, world, 2)
    runtime.choose(topology, train, group)
    runtime.rebuild(topology, train, events, group)
    exchange = runtime._exchange
    wait_own = exchange.wait_own

    def waiting(timeout):
        go.set()
        wait_own(timeout)

    exchange.wait_own = waiting  # type: ignore[method-assign]
    formation = {}  # the formation's state, whole: once the runtime's own hook let the step go

    def seen(*_):
        formation.update({n: t.clone() for n, t in runtime._live.items()})

    before = runtime.objects["optimizer"].register_step_pre_hook(seen)
    stepped = register_optimizer_step_post_hook(lambda *_: go.set())
    try:
        _train_step(runtime, 1)
    finally:
        stepped.remove()
        before.remove()
    runtime.before_commit()  # the formation's copies landed
    runtime.confirm_copies()  # and every rank waited for them: the commit is whole
    newest = _kept(runtime)[-1]
    own = newest.held.get(newest.own, {})
    return {"in_place": [e["in_place"] for e in resharded],
            "own_is_the_formation": bool(own) and all(torch.equal(own[n], formation[n])
                                                       for n in formation),
            "the_step_moved_on": any(not torch.equal(runtime._live[n], formation[n])
                                     for n in formation),
            "own_apart": not _storages(own) & _storages(runtime._live),
            "buddy_held": sorted(newest.held)}


def test_a_reshard_in_place_commits_the_formations_state_though_its_copy_lands_after_the_step(
        tmp_path):
    for result in run_in_group(_own_copy_after_an_in_place_reshard, 2, tmp_path).values():
        assert result == {"in_place": [True], "own_is_the_formation": True,
                          "the_step_moved_on": True, "own_apart": True, "buddy_held": [0, 1]}

"""heap.py: the trainer's loop keeps Python's garbage collector off its long-lived objects
(a full collection walked them all, 360-470 ms in main.py, pausing every thread), and
gives them back to it when training ends."""

import gc
import weakref

import pytest

import tiny
from attention_jax import heap, train


class Node:
    """A collectable object that can sit in a reference cycle."""

    def __init__(self):
        self.other = None


def _tracked(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # frozen objects are not listed


def _cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_frozen_heap_hides_what_existed_and_collects_dead_cycles_first():
    assert gc.get_freeze_count() == 0
    kept, dead = Node(), _cycle()
    with heap.FrozenHeap() as frozen:
        assert dead() is None  # a cycle already garbage is collected, not frozen dead
        assert gc.get_freeze_count() > 0 and not _tracked(kept)
        later, dead_later = Node(), _cycle()
        assert _tracked(later)
        frozen.settle()  # collects what died since, freezes what lives
        assert dead_later() is None and not _tracked(later)
        # Reference counting still frees a frozen object.
        gone = weakref.ref(later)
        del later
        assert gone() is None
    assert gc.get_freeze_count() == 0 and _tracked(kept)


def test_a_heap_frozen_by_the_process_or_a_disabled_collector_is_left_alone():
    gc.collect()
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with heap.FrozenHeap() as frozen:
            dead, made = _cycle(), Node()
            frozen.settle()
            assert dead() is not None  # ours would have collected it: nothing done
            assert _tracked(made)  # nor frozen what came since
        # Not unfrozen either (that empties the permanent generation). Not an exact count:
        # reference counting frees frozen objects too, on any thread (pytest's among them).
        assert gc.get_freeze_count() > count // 2 and _tracked(made)
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with heap.FrozenHeap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_pauses_records_each_collection_by_generation():
    with heap.Pauses() as pauses:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    gc.collect(2)  # after leaving: not recorded
    summary = pauses.summary()
    assert summary["gen2"]["count"] == 2 and summary["gen0"]["count"] >= 1
    assert 0 < summary["gen2"]["max_s"] <= summary["gen2"]["total_s"]
    assert pauses.total_s == pytest.approx(sum(g["total_s"] for g in summary.values()))
    pauses.clear()
    assert pauses.summary() == {} and pauses.total_s == 0


def test_the_training_loop_freezes_the_heap_and_unfreezes_it_after(tmp_path, monkeypatch):
    assert gc.get_freeze_count() == 0
    # What the frozen generation holds after each freeze and unfreeze, read as they
    # happen. (A thread polling gc.get_freeze_count, which walks that generation, held
    # the interpreter from the loop: 7 s alone, 117 s late in the suite's process.)
    counts = []

    def after(call):
        def recorded():
            call()
            counts.append(gc.get_freeze_count())
        return recorded

    monkeypatch.setattr(gc, "freeze", after(gc.freeze))
    monkeypatch.setattr(gc, "unfreeze", after(gc.unfreeze))
    train.train_and_evaluate(tiny.tiny_config(**{"train.steps": 30, "eval.every": 20}),
                             str(tmp_path))
    # Frozen objects that reference counting frees leave the count, so it drifts down;
    # each freeze makes it jump up.
    jumps = [b - a for a, b in zip([0] + counts, counts) if b - a > 1000]
    assert jumps[0] > 10_000  # JAX, Flax, orbax and the model: the long-lived heap
    # Frozen again after the first step's compilation and after the first evaluation's.
    assert len(jumps) == 3, (jumps, counts)
    assert counts[-1] == 0 and gc.get_freeze_count() == 0  # unfrozen at the end


def _layers(n: int, width: int):
    import jax.numpy as jnp
    return {f"layer{i}": {"w": jnp.ones((width, 8)), "mu": jnp.zeros((width, 8))} for i in range(n)}


def test_the_save_programs_freeze_what_compiling_them_made(tmp_path):
    """Compiling a save's programs for many arrays leaves objects that live as long as the
    loop (about 290,000 for GPT-2 small on an H200, walked by every full collection);
    `prepare(on_compiled=frozen.settle)` freezes them once compiled, on their thread."""
    from attention_jax import checkpoint
    unfrozen = {}
    for settles, width in ((False, 24), (True, 40)):  # widths: no compilation cache shared
        ckpt = checkpoint.Checkpointer(str(tmp_path / f"c{width}"), save_every=1, keep=1)
        try:
            with heap.FrozenHeap() as frozen:
                state = _layers(120, width)
                frozen.settle()
                ckpt.prepare(state, device_programs=True,
                             on_compiled=frozen.settle if settles else None)
                ckpt._programs.get(state)  # waits for the compilation (and its callback)
                unfrozen[settles] = len(gc.get_objects())
        finally:
            ckpt.close()
    assert unfrozen[False] > 10_000, unfrozen  # what compiling them made
    assert unfrozen[True] < unfrozen[False] / 10, unfrozen


def test_settle_after_the_context_has_exited_does_nothing():
    frozen = heap.FrozenHeap()
    with frozen:
        pass
    frozen.settle()  # a save programs' thread finishing after the loop
    assert gc.get_freeze_count() == 0

"""grain loaders: exact resume (shuffle, several epochs), disjoint covering process
shards, resume on a different process count, and global jax.Array batches."""

import json
import gc

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from attention_jax import data
from attention_jax.data.loaders import EXAMPLE_WEIGHT

N = 50  # Records in the toy source; not a multiple of the batch sizes used below.


def _source(n=N):
    return [{'index': np.int64(i), 'x': np.full((3,), i, np.float32)} for i in range(n)]


def _take(loader, k=None):
    out = []
    for batch in loader:
        out.append(batch)
        if k is not None and len(out) == k:
            break
    return out


def _indices(batches):
    return np.concatenate([b['index'] for b in batches]) if batches else np.zeros(0, int)


def _add_noise(record, rng):
    return {**record, 'noise': rng.integers(0, 2**31)}


@pytest.mark.parametrize('k', [1, 7, 13])
def test_resume_continues_exactly_with_shuffle_and_epochs(k):
    kwargs = dict(global_batch_size=8, seed=5, num_epochs=3, transform=_add_noise,
                  process_index=0, process_count=1)
    full = _take(data.Loader(_source(), **kwargs))
    assert len(full) == (3 * N) // 8
    first = data.Loader(_source(), **kwargs)
    head = _take(first, k)
    state = json.dumps(first.get_state().to_dict())  # What a checkpoint stores.
    resumed = _take(data.Loader(_source(), state=json.loads(state), **kwargs))
    assert len(head) + len(resumed) == len(full)
    for got, want in zip(head + resumed, full):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_each_epoch_is_a_new_permutation_and_transform_rng_changes():
    loader = data.Loader(_source(), global_batch_size=10, seed=1, num_epochs=2,
                              transform=_add_noise, process_index=0, process_count=1)
    batches = _take(loader)
    order = _indices(batches)
    noise = np.concatenate([b['noise'] for b in batches])
    assert sorted(order[:N]) == list(range(N)) and sorted(order[N:]) == list(range(N))
    assert list(order[:N]) != list(range(N))  # Shuffled ...
    assert list(order[:N]) != list(order[N:])  # ... differently per epoch.
    by_record = {}
    for i, z in zip(order, noise):
        by_record.setdefault(int(i), []).append(int(z))
    assert all(a != b for a, b in by_record.values())  # Fresh augmentation per epoch.
    other_seed = data.Loader(_source(), global_batch_size=10, seed=2, num_epochs=1,
                                  process_index=0, process_count=1)
    assert list(_indices(_take(other_seed))) != list(order[:N])


def test_the_next_seed_does_not_see_this_seed_s_epochs_late():
    """grain reseeds its shuffle with seed + epoch: seed 1's epoch 0 was seed 0's epoch 1,
    so a multi-epoch sweep over seeds 0, 1, 2 shared its data order. Each seed's epochs
    now start from their own base (order_seed), on both reading paths; a state saved
    before (no `order`) resumes in the order its run began."""
    from grain.experimental import index_shuffle
    from attention_jax.data import loaders
    class Rows(list):  # a source read a batch per call (the batched path)
        def read_rows(self, indices):
            return {'index': np.asarray(indices, np.int64)}

    def order(seed, epochs, source=None, **kw):
        loader = data.Loader(source or _source(), global_batch_size=N, seed=seed,
                             num_epochs=epochs, process_index=0, process_count=1, **kw)
        stream = [int(i) for i in _indices(_take(loader))]
        return [stream[e * N:(e + 1) * N] for e in range(epochs)]
    zero, one = order(0, 3), order(1, 2)
    assert zero[1] != one[0] and zero[2] != one[1]
    assert one == order(1, 2, Rows(_source()), batched=True)  # both paths, one order
    # A state from before `order` existed: the epochs of its seed's old order, seed + e.
    old = data.Loader(_source(), global_batch_size=N, seed=0, num_epochs=3, process_index=0,
                      process_count=1, state={'next_index': N, 'seed': 0, 'num_records': N})
    assert old.get_state().order == 0
    want = [index_shuffle(i, max_index=N - 1, seed=1, rounds=4) for i in range(N)]
    assert list(_indices(_take(old, 1))) == want
    assert loaders.LoaderState.from_any(data.Loader(
        _source(), global_batch_size=N, process_index=0, process_count=1
    ).get_state().to_dict()).order == loaders.ORDER == 1


def test_two_processes_are_disjoint_cover_the_epoch_and_match_one_process():
    def run(p, count):
        return _take(data.Loader(_source(40), global_batch_size=10, seed=3, num_epochs=1,
                                      process_index=p, process_count=count))
    p0, p1 = run(0, 2), run(1, 2)
    assert len(p0) == len(p1) == 4 and p0[0]['index'].shape == (5,)
    a, b = set(_indices(p0).tolist()), set(_indices(p1).tolist())
    assert not a & b and a | b == set(range(40))
    # Global step s is process 0's block followed by process 1's.
    single = run(0, 1)
    for s in range(4):
        np.testing.assert_array_equal(
            np.concatenate([p0[s]['index'], p1[s]['index']]), single[s]['index'])


def test_partial_final_global_batch_is_dropped_on_every_process():
    def run(p):
        return _take(data.Loader(_source(), global_batch_size=12, seed=0, num_epochs=1,
                                      process_index=p, process_count=3))
    counts = [len(run(p)) for p in range(3)]
    assert counts == [N // 12] * 3  # Processes never disagree on the number of steps.


@pytest.mark.parametrize('count', [1, 3])
def test_pad_remainder_gives_every_example_once_and_weights_the_padding_zero(count):
    """Evaluation's loader: 50 examples in global batches of 12 are 5 batches on every
    process, the last one 2 examples and 10 copies weighted 0."""
    def run(p):
        return data.Loader(_source(), global_batch_size=12, seed=0, shuffle=False, num_epochs=1,
                           process_index=p, process_count=count, pad_remainder=True)
    loaders = [run(p) for p in range(count)]
    assert [len(loader) for loader in loaders] == [5] * count
    batches = [_take(loader) for loader in loaders]
    assert [len(b) for b in batches] == [5] * count  # every process, the same steps
    index = np.concatenate([b['index'] for s in range(5) for b in (p[s] for p in batches)])
    w = np.concatenate([b[EXAMPLE_WEIGHT] for s in range(5) for b in (p[s] for p in batches)])
    assert w.dtype == np.float32 and set(w.tolist()) == {0.0, 1.0}
    np.testing.assert_array_equal(index[w == 1], np.arange(N))  # each once, in order
    assert (w[:N] == 1).all() and (w[N:] == 0).all() and len(w) == 60
    # The padding rows are real examples (valid inputs), not zeros.
    np.testing.assert_array_equal(index[N:], np.arange(10))
    for b in batches[0]:
        np.testing.assert_array_equal(b['x'][:, 0], b['index'])
    # Finished: the state is the end of the stream, and nothing is left to read.
    assert loaders[0].get_state().next_index == N and len(loaders[0]) == 0
    assert _take(data.Loader(_source(), global_batch_size=12, num_epochs=1, process_index=0,
                             process_count=1, pad_remainder=True,
                             state=loaders[0].get_state())) == []


def test_pad_remainder_with_a_whole_last_batch_adds_no_padding_and_resumes():
    kwargs = dict(global_batch_size=10, seed=2, num_epochs=1, transform=_add_noise,
                  process_index=0, process_count=1, pad_remainder=True)
    full = _take(data.Loader(_source(), **kwargs))
    assert len(full) == 5 and all((b[EXAMPLE_WEIGHT] == 1).all() for b in full)
    # The transform's rng is the stream's, padded or not: the same examples as unpadded.
    plain = _take(data.Loader(_source(), **{**kwargs, 'pad_remainder': False}))
    for a, b in zip(full, plain):
        np.testing.assert_array_equal(a['noise'], b['noise'])
    first = data.Loader(_source(), **kwargs)
    head = _take(first, 2)
    rest = _take(data.Loader(_source(), state=first.get_state(), **kwargs))
    assert len(head) + len(rest) == 5
    np.testing.assert_array_equal(_indices(head + rest), _indices(full))


def test_pad_remainder_is_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match='pad_remainder=True needs a finite num_epochs'):
        data.Loader(_source(), global_batch_size=8, num_epochs=None, pad_remainder=True,
                    process_index=0, process_count=1)
    rows = [np.full((3,), i, np.float32) for i in range(5)]  # not dicts: no field to add
    with pytest.raises(TypeError, match="needs dict examples"):
        _take(data.Loader(rows, global_batch_size=4, num_epochs=1, pad_remainder=True,
                          process_index=0, process_count=1))


def test_resume_on_a_different_process_count():
    kwargs = dict(global_batch_size=8, seed=9, num_epochs=2)
    loaders = [data.Loader(_source(), process_index=p, process_count=2, **kwargs)
               for p in range(2)]
    for loader in loaders:
        _take(loader, 5)
    state = loaders[0].get_state()
    assert state == loaders[1].get_state()  # Every process holds the same state.
    continued_two = [_take(loader) for loader in loaders]
    one = _take(data.Loader(_source(), process_index=0, process_count=1, state=state,
                                 **kwargs))
    assert len(one) == len(continued_two[0])
    for s, batch in enumerate(one):
        np.testing.assert_array_equal(
            batch['index'],
            np.concatenate([continued_two[0][s]['index'], continued_two[1][s]['index']]))


def test_state_from_another_dataset_or_seed_is_refused():
    loader = data.Loader(_source(), global_batch_size=8, seed=1, process_index=0,
                              process_count=1)
    _take(loader, 2)
    state = loader.get_state().to_bytes()
    with pytest.raises(ValueError, match='seed=1'):
        data.Loader(_source(), global_batch_size=8, seed=2, state=state,
                         process_index=0, process_count=1)
    with pytest.raises(ValueError, match='num_records=50'):
        data.Loader(_source(49), global_batch_size=8, seed=1, state=state,
                         process_index=0, process_count=1)
    with pytest.raises(ValueError, match='multiple of process_count=3'):
        data.Loader(_source(), global_batch_size=8, process_index=0, process_count=3)


def test_worker_processes_give_the_same_batches():
    kwargs = dict(global_batch_size=8, seed=4, num_epochs=1, transform=_add_noise,
                  process_index=0, process_count=1)
    inline = _take(data.Loader(_source(), **kwargs))
    workers = _take(data.Loader(_source(), worker_count=1, **kwargs))
    assert len(inline) == len(workers)
    for a, b in zip(inline, workers):
        np.testing.assert_array_equal(a['index'], b['index'])
        np.testing.assert_array_equal(a['noise'], b['noise'])
    # The worker pool's semaphores are finalised when collected; collected later, inside
    # tfds' lazy-import context (the next test builds a dataset), their cleanup's relative
    # import fails there and pytest (intermittently) fails that test on it.
    gc.collect()


def test_tfds_source_with_image_transform_resumes(tmp_path):
    source = data.get_dataset('digits', 'test', tmp_path)
    transform = data.ImageClassification(augment=True, padding=1)
    kwargs = dict(global_batch_size=16, seed=0, num_epochs=2, transform=transform,
                  process_index=0, process_count=1)
    full = _take(data.Loader(source, **kwargs))
    first = data.Loader(source, **kwargs)
    head = _take(first, 30)  # 359 // 16 = 22 steps per epoch: crosses into epoch 2.
    rest = _take(data.Loader(source, state=first.get_state(), **kwargs))
    assert full[0]['image'].shape == (16, 8, 8, 1) and full[0]['image'].dtype == np.float32
    for got, want in zip(head + rest, full):
        np.testing.assert_array_equal(got['image'], want['image'])
        np.testing.assert_array_equal(got['label'], want['label'])


def test_to_global_batch_shards_along_data_axes():
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(-1, 1), ('data', 'tensor'))
    local = {'tokens': np.arange(4 * len(devices) * 3).reshape(4 * len(devices), 3)}
    out = data.to_global_batch(local, mesh, data_axes='data')
    arr = out['tokens']
    assert isinstance(arr, jax.Array) and arr.shape == local['tokens'].shape
    np.testing.assert_array_equal(np.asarray(arr), local['tokens'])
    assert arr.sharding.spec[0] in ('data', ('data',))
    assert len(arr.addressable_shards) == len(devices)
    assert {s.data.shape for s in arr.addressable_shards} == {(4, 3)}
    # Several mesh axes split the batch jointly (data parallel x FSDP).
    mesh2 = Mesh(devices.reshape(len(devices) // 2, 2), ('data', 'fsdp'))
    arr2 = data.to_global_batch(local, mesh2, data_axes=('data', 'fsdp'))['tokens']
    np.testing.assert_array_equal(np.asarray(arr2), local['tokens'])
    assert {s.data.shape for s in arr2.addressable_shards} == {(4, 3)}
    with pytest.raises(ValueError, match='not mesh axes'):
        data.to_global_batch(local, mesh, data_axes=('fsdp',))


def test_loader_workers_end_with_a_killed_trainer(tmp_path):
    """After a SIGKILL of the training process, grain's loader workers (hundreds of MB
    each with images) lived on under init for ever. Each now ends once its parent is gone."""
    from helpers import children_outliving
    (tmp_path / 'trainer.py').write_text(
        "import os, time\n"
        "import numpy as np\n"
        "from attention_jax.data import loaders\n"
        "if __name__ == '__main__':\n"
        "    source = [{'x': np.full(4, i, np.int32)} for i in range(64)]\n"
        "    it = iter(loaders.Loader(source, global_batch_size=4, seed=0, worker_count=2))\n"
        "    next(it)  # the workers are up\n"
        "    me = str(os.getpid())\n"
        "    kids = [p for p in os.listdir('/proc') if p.isdigit() and\n"
        "            open(f'/proc/{p}/stat').read().split(') ')[1].split()[1] == me]\n"
        "    print(*kids, flush=True)\n"
        "    time.sleep(120)\n")
    children, left = children_outliving(tmp_path / 'trainer.py', {'JAX_PLATFORMS': 'cpu'})
    assert len(children) >= 2  # the two workers (and multiprocessing's resource tracker)
    assert not left


def test_loader_workers_leave_ctrl_c_to_the_trainer(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group. grain's loader workers died
    of it, each printing a KeyboardInterrupt traceback, while the trainer (which handles
    SIGINT: finish the step, save, stop) was still taking batches. They now ignore it;
    the trainer's closing the loader ends them."""
    import os
    import signal
    import subprocess
    import sys
    (tmp_path / 'trainer.py').write_text(
        "import signal, sys\n"
        "import numpy as np\n"
        "from attention_jax.data import loaders\n"
        "if __name__ == '__main__':\n"
        "    stop = []\n"
        "    signal.signal(signal.SIGINT, lambda *_: stop.append(1))\n"
        "    source = [{'x': np.full(4, i, np.int32)} for i in range(64)]\n"
        "    it = iter(loaders.Loader(source, global_batch_size=4, seed=0, worker_count=2))\n"
        "    next(it), next(it)  # each worker has made a batch: it is past its init\n"
        "    print('up', flush=True)\n"
        "    while not stop:\n"
        "        next(it)\n"
        "    for _ in range(8):  # batches taken after the Ctrl-C still come\n"
        "        next(it)\n"
        "    it.close()\n"
        "    print('closed', flush=True)\n")
    proc = subprocess.Popen([sys.executable, str(tmp_path / 'trainer.py')],
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    try:
        assert proc.stdout.readline().strip() == 'up'
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and 'closed' in out, err[-3000:]
    assert 'KeyboardInterrupt' not in err and 'leaked' not in err, err[-3000:]

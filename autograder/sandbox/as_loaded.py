"""The student's namespace *as loaded*: what every multi-process run starts from.

The notebook promises that ``launch`` runs a function on fresh processes. In the grader the
same namespace serves many checks, one after the other, and student code may change it while a
check runs: Megatron's ``parallel_state`` and picotron's group manager keep the process groups
they create in module-level globals, a class attribute can cache a group, a dict can collect
handles. Pickled into the next check's ranks as they are *then*, those globals would carry a
``ProcessGroup`` (which cannot be pickled) or a group destroyed with the last run.

So the worker records the namespace right after the cells ran (:func:`record`): the objects
themselves, and one cloudpickle of all of them (one pickle, so that the functions in it share
one globals dictionary again, as in the notebook). A run then sends its function and arguments
with every object that was in the namespace at load time replaced by a reference into that
snapshot (:func:`dumps`), and each rank rebuilds the snapshot and resolves the references
(:func:`loads`): the ranks see the cells' state as loaded, whatever earlier checks left behind.

Runs on one rank in the grader's own process (no process start) use the live objects; they do
so only while :func:`changed_since_load` says nothing a run could see has changed.

Runs in the sandbox and in ranks, beside student code: never imports pytest.
"""
from __future__ import annotations

import io
import pickle
import types

#: Pickled size (bytes) above which an object stays out of the snapshot.
LARGE = 8 << 20
#: Types whose values are the same whichever copy a run gets: never replaced by a reference.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, types.ModuleType)

_live: dict | None = None                  # the namespace the checks use
_at_load: dict[str, object] = {}           # name -> the object as loaded (all of them)
_loaded: dict[str, object] | None = None   # those in the snapshot
_snapshot: bytes | None = None             # cloudpickle of those objects (picklable ones)
_shallow: dict[str, object] = {}           # name -> a shallow copy of its contents, to compare


def _pickler_class():
    """The launcher's pickler: functions and classes of the notebook by value, code objects
    with their file names (so a rank's traceback names the student's cell and line)."""
    from course.launch import pickler_keeping_filenames

    return pickler_keeping_filenames()


def _dumps(obj, pickler=None) -> bytes:
    buf = io.BytesIO()
    (pickler or _pickler_class())(buf).dump(obj)
    return buf.getvalue()


def _student_names(ns: dict) -> dict[str, object]:
    return {n: v for n, v in ns.items()
            if not (n.startswith("__") and n.endswith("__")) and n != "get_ipython"}


def _contents(value):
    """What a later change inside ``value`` would alter: its attributes or items, shallowly."""
    if isinstance(value, type):
        return dict(vars(value))
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, set)):
        return list(value)
    if hasattr(value, "__dict__") and not isinstance(value, (types.FunctionType, types.ModuleType)):
        try:
            return dict(vars(value))
        except TypeError:
            return None
    return None


def record(ns: dict) -> list[str]:
    """Remember ``ns`` as it is now (right after loading). Returns the names left out of the
    snapshot: those that cannot be pickled (runs that need them fail as they would have, with
    pickle's message) and large data (over :data:`LARGE` once pickled, e.g. a data set or a
    model built at the top of a cell), which runs send as it is then, so that every run does
    not ship it."""
    global _live, _at_load, _loaded, _snapshot
    _live = ns
    objects = _student_names(ns)
    _at_load = dict(objects)
    left_out: list[str] = []
    try:
        _snapshot = _dumps(objects)
    except Exception:  # noqa: BLE001 - find the culprits below
        _snapshot = None
    if _snapshot is None or len(_snapshot) > LARGE:
        for name, value in list(objects.items()):
            try:
                too_large = len(_dumps(value)) > LARGE
            except Exception:  # noqa: BLE001
                too_large = True
            if too_large:
                left_out.append(name)
                del objects[name]
        try:
            _snapshot = _dumps(objects)
        except Exception:  # noqa: BLE001 - only together unpicklable: runs use live objects
            _snapshot, objects = None, {}
    _loaded = objects
    _shallow.clear()
    _shallow.update({n: c for n, v in objects.items() if (c := _contents(v)) is not None})
    return left_out


def changed_since_load() -> bool:
    """Whether a run from the live namespace could see something other than the cells' state
    as loaded: a name bound, rebound or deleted, or the attributes or items of a loaded object
    changed (one level deep)."""
    if _loaded is None or _live is None:
        return False
    live = _student_names(_live)
    if set(live) != set(_at_load):
        return True
    if any(live[n] is not v for n, v in _at_load.items()):
        return True
    for name, before in _shallow.items():
        after = _contents(_loaded[name])
        if after is None or (isinstance(before, dict) != isinstance(after, dict)):
            return True
        if isinstance(before, dict):
            if before.keys() != after.keys() or any(after[k] is not v for k, v in before.items()):
                return True
        elif len(before) != len(after) or any(a is not b for a, b in zip(after, before)):
            return True
    return False


def dumps(obj) -> bytes:
    """``obj`` pickled for a run: objects of the namespace as loaded travel as references
    into the snapshot (which goes along), everything else by value."""
    by_id = {id(v): n for n, v in (_loaded or {}).items() if not isinstance(v, _ATOMS)}

    class _Pickler(_pickler_class()):
        def persistent_id(self, value):
            name = by_id.get(id(value))
            return name if name is not None and _loaded[name] is value else None

    return pickle.dumps((_snapshot, _dumps(obj, _Pickler)))


def loads(data: bytes):
    """In a rank: the object :func:`dumps` sent, its references resolved into a fresh copy of
    the namespace as loaded."""
    snapshot, payload = pickle.loads(data)
    objects = pickle.loads(snapshot) if snapshot is not None else {}

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, name):
            return objects[name]

    return _Unpickler(io.BytesIO(payload)).load()


def exact_float32() -> None:
    """float32 arithmetic means float32 in every check: no TF32 in cuBLAS matmuls or cuDNN
    convolutions. Why: PyTorch lets cuDNN use TF32 (a 10-bit mantissa) by default, while every
    float32 bar is derived from IEEE float32 runs; on an H200, A1's reference lost a check when
    its LeNet step strayed 1.5e-3 from float64. Called before each probe call in the sandbox
    and before the function on each rank (student code may change it again: that is its own)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

"""torch.compile for objects whose state stays put while their compiled methods run.

Before every call of a compiled function dynamo checks its guards: the type, shape, strides and aliasing of
every tensor the function reads and, with dynamic shapes, relations between their sizes, some of them in
Python. A forward reads hundreds of weight tensors from its object, and checking them costs 1 to 2 ms a call
on this CPU: a fifth of an int4 decode step of SmolLM2-135M. For an object whose tensors are not replaced
while the compiled method is in use, `compile_frozen`
- gives those tensors static shapes (no size relations to check, and tighter code),
- drops the guards on the object (`self`) and keeps those on the arguments (caches, ids, positions, masks),
- compiles a copy of the method with a code object of its own: dynamo keeps graphs per code object, so no
  other object can ever run a graph whose guards on `self` were dropped.
The graphs still read the tensors from the object at every call, so new values written in place are seen.

They also trace without duck shapes: by default dynamo gives sizes that happen to be equal when it traces
(two rows verifying blocks of two) one symbol, and would compile again for the first step where they differ.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import types

import torch
import torch.nn as nn
from torch.fx.experimental import _config as shape_config

from .machine import dflash_home

_copies = itertools.count()


def tensors_of(objs) -> list[torch.Tensor]:
    """The tensors held by objs: tensors, modules (parameters and buffers), lists/tuples, and the attributes
    of other objects (our weight wrappers)."""
    found = {}
    for o in objs:
        if isinstance(o, torch.Tensor):
            found[id(o)] = o
        elif isinstance(o, nn.Module):
            found.update((id(t), t) for t in (*o.parameters(), *o.buffers()))
        elif isinstance(o, (list, tuple)):
            found.update((id(t), t) for t in tensors_of(o))
        elif hasattr(o, "__dict__") and not callable(o):  # an operator (a kernel's handle) holds no weights
            found.update((id(t), t) for t in tensors_of(vars(o).values()))
    return list(found.values())


def _own_copy(method):
    """method, bound to the same object, through a copy of its function with a code object of its own."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.MethodType(types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                                               fn.__closure__), method.__self__)


def _guards_off_self(entries) -> list[bool]:
    """torch.compile's guard_filter_fn: keeps the guards on everything but the compiled method's `self`."""
    return [not e.name.startswith(("self.", "self[")) for e in entries]


def compile_frozen(method, state, cuda_graphs: bool = False):
    """torch.compile(method, dynamic=True) for a bound method whose object holds the tensors of `state`
    (see the module doc). Inductor keeps compiled code on disk under DFLASH_HOME unless
    TORCHINDUCTOR_CACHE_DIR says otherwise, so a later process only traces again. cuda_graphs: static shapes,
    each graph replayed as a CUDA graph (inductor's cudagraph trees, as mode="reduce-overhead")."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(dflash_home() / "inductor"))
    for t in tensors_of(state):
        torch._dynamo.mark_static(t)
    options = {"guard_filter_fn": _guards_off_self}
    if cuda_graphs:
        options["triton.cudagraphs"] = True
    compiled = torch.compile(_own_copy(method), dynamic=not cuda_graphs, options=options)

    def call(*args, **kwargs):
        # read when dynamo traces; set around every call, as tracing starts inside one (a few µs)
        duck, shape_config.use_duck_shape = shape_config.use_duck_shape, False
        try:
            return compiled(*args, **kwargs)
        finally:
            shape_config.use_duck_shape = duck
    return call


@contextlib.contextmanager
def built_graphs_only():
    """Compiled functions run only the graphs they already have: a call that would compile runs eagerly. (The
    functional form of torch.compiler.set_stance: its context manager costs about 0.1 ms.)"""
    torch.compiler.set_stance("eager_on_recompile")
    try:
        yield
    finally:
        torch.compiler.set_stance("default")

"""The part of orbax.checkpoint's CheckpointManager a training loop uses.

    # import orbax.checkpoint as ocp
    from ckptio import orbax as ocp

    mgr = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    mgr.save(step, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
    state = mgr.restore(mgr.latest_step(), args=ocp.args.StandardRestore(abstract_state))

A loop written against orbax changes its import (and nothing else, for the
calls below). Differences:

- The layout on disk is ckptio's (``<path>/<step>/manifest.json`` and
  safetensors shards; orbax's step directories are bare step numbers, and
  so are these), not orbax's: ckptio reads its own checkpoints only.
- ``args`` are ``StandardSave`` / ``StandardRestore`` / ``PyTreeSave`` /
  ``PyTreeRestore`` (a tree of arrays), ``JsonSave`` / ``JsonRestore`` (a
  tree of JSON values), and a ``Composite`` of those, stored as one tree
  with an item per name (``item_names`` is not needed). Other orbax
  handlers' args (datasets' iterators, for one) are not provided.
- ``CheckpointManagerOptions`` honours ``max_to_keep``, ``keep_period``,
  ``save_interval_steps``, ``save_on_steps``, ``should_save_fn``,
  ``read_only`` and ``step_prefix``, and ``should_save`` decides as orbax's
  default policy does (the first save of a directory is always made);
  ``best_fn`` raises (ckptio keeps the newest steps, it would delete the
  best ones); other fields are accepted and ignored. The constructor's
  ``checkpointers``, ``metadata``, ``item_handlers``, ``logger`` and
  ``handler_registry`` are accepted and ignored.
- ``save`` and ``restore`` take orbax's parameters in orbax's order; a
  bare pytree as ``items`` (orbax's older calls) works as ``args`` would.
  ``save_kwargs``, ``restore_kwargs`` and ``metrics`` are accepted and
  ignored (there is no ``best_fn``: ``max_to_keep`` keeps the newest).
- Saves are always asynchronous (orbax's ``enable_async_checkpointing``).
- Multi-process jobs (``jax.distributed.initialize``) need nothing more:
  the process index, count and barrier come from jax.
"""
import dataclasses
import types
from collections.abc import Mapping

from ._manager import CheckpointManager as _Manager


@dataclasses.dataclass
class CheckpointManagerOptions:
    save_interval_steps: int = 1
    max_to_keep: int = None
    keep_period: int = None
    step_prefix: str = None
    save_on_steps: object = None
    should_save_fn: object = None
    read_only: bool = False
    enable_async_checkpointing: bool = True
    create: bool = True

    def __init__(self, save_interval_steps=1, max_to_keep=None, keep_period=None, step_prefix=None,
                 save_on_steps=None, should_save_fn=None, read_only=False, best_fn=None, **ignored):
        if best_fn is not None:
            raise NotImplementedError("CheckpointManagerOptions(best_fn=...) is not supported by ckptio.orbax: "
                                      "max_to_keep keeps the newest steps (keep_period keeps every n-th too)")
        self.save_interval_steps, self.max_to_keep, self.keep_period = save_interval_steps, max_to_keep, keep_period
        self.step_prefix, self.save_on_steps, self.should_save_fn = step_prefix, save_on_steps, should_save_fn
        self.read_only = read_only
        self.enable_async_checkpointing, self.create = True, True


@dataclasses.dataclass
class _Item:
    item: object = None


class StandardSave(_Item):
    pass


class StandardRestore(_Item):
    pass


class PyTreeSave(_Item):
    pass


class PyTreeRestore(_Item):
    pass


class JsonSave(_Item):
    pass


class JsonRestore(_Item):
    pass


class Composite(Mapping):
    """Several named items saved or restored together, as orbax's
    ``args.Composite(state=StandardSave(...), meta=JsonSave(...))``; a
    restore returns one whose items are the restored trees (``r.state``,
    ``r["state"]``)."""

    def __init__(self, **items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __getattr__(self, key):
        try:
            return self.__dict__["_items"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __repr__(self):
        return f"Composite({', '.join(f'{k}={v!r}' for k, v in self._items.items())})"


args = types.SimpleNamespace(StandardSave=StandardSave, StandardRestore=StandardRestore, PyTreeSave=PyTreeSave,
                             PyTreeRestore=PyTreeRestore, JsonSave=JsonSave, JsonRestore=JsonRestore,
                             Composite=Composite)


def _item(x):
    """The pytree of ``args`` (StandardSave(tree) and the like; a Composite:
    a dict of its items' trees), or ``x`` itself when passed bare (orbax's
    older ``items``)."""
    if isinstance(x, Composite):
        return {name: _item(arg) for name, arg in x.items()}
    return x.item if isinstance(x, _Item) else x


def _restore(manager, step, request, composite):
    """Restores ``step`` (None: the latest) of ``manager`` shaped like
    ``request``. The items of a Composite given without a target
    (``JsonRestore()``) come back as saved."""
    step = manager._step_to_read(step)  # once: the skeleton and the restore read the same step
    target = _item(request)
    if isinstance(request, Composite) and any(t is None for t in target.values()):
        saved = manager._skeleton(step)
        for name, t in target.items():
            if t is not None:
                continue
            if not isinstance(saved, Mapping) or name not in saved:
                held = ", ".join(repr(k) for k in sorted(saved, key=str)) if isinstance(saved, Mapping) else "one unnamed item"
                raise ValueError(f"the checkpoint of step {step} in {manager.root} has no item {name!r} "
                                 f"(it holds {held})")
            target[name] = saved[name]
    tree = manager.restore(step, target=target)
    if (isinstance(request, Composite) or (request is None and composite)) and isinstance(tree, Mapping):
        return Composite(**tree)
    return tree


class CheckpointManager:
    """orbax.checkpoint.CheckpointManager's save / restore / step surface over
    a ckptio.CheckpointManager (``.manager``). Keyword ``options`` of ckptio
    (``staging_memory="1GiB"``, ...) pass through as ``**ckptio_options``."""

    def __init__(self, directory, checkpointers=None, options=None, metadata=None, item_names=None,
                 item_handlers=None, logger=None, handler_registry=None, **ckptio_options):
        del checkpointers, metadata, item_handlers, logger, handler_registry  # orbax's machinery, not needed
        self._composite = item_names is not None  # restore() without args gives a Composite, as orbax
        options = options or CheckpointManagerOptions()
        self._options = options
        self._interval = max(1, int(options.save_interval_steps or 1))
        keep = options.max_to_keep if options.max_to_keep is not None else 0  # orbax keeps all by default
        ckptio_options.setdefault("prefix", options.step_prefix + "_" if options.step_prefix else "")
        self._prefix = ckptio_options["prefix"]
        if options.read_only:
            self.manager = _Manager(str(directory), read_only=True, **ckptio_options)
        else:
            self.manager = _Manager(str(directory), keep=keep, keep_every=options.keep_period, **ckptio_options)

    def should_save(self, step):
        """orbax's default decision: not at or below the newest step (saved
        or in flight), nor when read-only; then ``should_save_fn(step,
        newest)`` if given, else a multiple of ``save_interval_steps``, a step
        of ``save_on_steps``, or the first save of the directory."""
        if self._options.read_only:
            return False
        latest = self.manager.latest_step()
        in_flight = self.manager.saves_in_flight()
        newest = max([s for s in [latest] + in_flight if s is not None], default=None)
        if newest is not None and newest >= step:
            return False
        if self._options.should_save_fn is not None:
            return bool(self._options.should_save_fn(step, newest))
        on_steps = self._options.save_on_steps
        return step % self._interval == 0 or (on_steps is not None and step in on_steps) or newest is None

    def save(self, step, items=None, save_kwargs=None, metrics=None, force=False, args=None,
             custom_metadata=None, *, metadata=None):
        """Saves ``args.item`` (a pytree) as ``step`` in the background;
        returns False (and saves nothing) when ``should_save(step)`` is
        False and ``force`` is not set. The parameters are orbax's, in its
        order: ``items`` (orbax's older way, a pytree) is saved as ``args``
        would be; ``save_kwargs`` and ``metrics`` are accepted and ignored;
        ``custom_metadata`` (or ``metadata``) is stored with the step."""
        del save_kwargs, metrics
        tree = _item(args if args is not None else items)
        if tree is None:
            raise ValueError("save: pass args=ocp.args.StandardSave(tree)")
        if not force and not self.should_save(step):
            return False
        self.manager.save(step, tree, metadata=custom_metadata if custom_metadata is not None else metadata)
        return True

    def restore(self, step=None, items=None, restore_kwargs=None, directory=None, args=None):
        """The checkpoint of ``step`` (default: the latest), shaped like
        ``args.item`` (jax.ShapeDtypeStructs with shardings give jax.Arrays
        on those shardings), or as saved without one. ``directory``, as in
        orbax, reads another run's checkpoints (ckptio's own)."""
        del restore_kwargs
        request = args if args is not None else items
        if directory is not None and str(directory) != self.manager.root:
            with _Manager(str(directory), read_only=True, prefix=self._prefix) as other:
                return _restore(other, step, request, self._composite)
        return _restore(self.manager, step, request, self._composite)

    def item_metadata(self, step):
        return self.manager.info(step)

    def metadata(self, step=None):
        return self.manager.metadata(step)

    def latest_step(self):
        return self.manager.latest_step()

    def all_steps(self, read=False):
        del read
        return self.manager.all_steps()

    def delete(self, step):
        self.manager.delete(step)

    def wait_until_finished(self):
        self.manager.wait_until_finished()

    def check_for_errors(self):
        """Raises the failure of a background save not reported yet."""
        if not self.manager.saves_in_flight():
            self.manager.wait_until_finished()

    @property
    def directory(self):
        return self.manager.root

    def close(self):
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

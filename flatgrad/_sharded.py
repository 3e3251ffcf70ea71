"""`ShardedOptimizer`: ZeRO-1 over `replicate`'s buckets of the one flat buffer, by element (flat shards:
`flatgrad._zero`) or by tensor (``shard_by="tensor"``: whole parameters per rank, for optimizers that update
each tensor as a whole, `flatgrad._zero_tensor`); `flatgrad._optim_kinds.shard_kind` says which way a class
may go. How it works: docs/design.md, "ShardedOptimizer"; what it refuses and why: docs/data-parallel.md,
"ShardedOptimizer (ZeRO-1)".

With ``overlap_param_gather`` on gloo the shards split each bucket rather than each whole buffer, so
`clip_grad_norm_` sums over other shards: equal to the last bit or two. After backward, a `.grad` is averaged
only inside this rank's shards; until zeroed it is a `flatgrad._scattered_grad.ScatteredGrad` raising on any
read of its values, so a stock clip or logged norm fails on every rank instead of differing between them."""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.distributed.device_mesh import DeviceMesh

from flatgrad._buffer import MAIN_GRAD_GUARD, GradStore, groups_key
from flatgrad._dtensor import local_of, move_into, pipeline_group
from flatgrad._flatgrad import engine_of
from flatgrad._gather_waits import ForwardWaits
from flatgrad._optim_kinds import ShardBy, agreed_kind, shard_kind
from flatgrad._parallel import ReplicateModule, ReplicateState, replicate_state
from flatgrad._scattered_grad import is_scattered, unguarded, unmark_scattered
from flatgrad._torch_compat import SAVED_SHARDS, join_state, leave_join
from flatgrad._zero import (
    PieceGroups,
    ShardEngine,
    as_groups,
    check_members,
    checked_defaults,
    on_every_rank,
    options,
    relaid_state,
    state_bytes,
)
from flatgrad._zero_state import (
    CLASS_STATE,
    GroupView,
    OptimizerRecipe,
    first_step_keys,
    whole_state,
    with_stepped_options,
    without_stepped_options,
)
from flatgrad._zero_tensor import TensorEngine, TensorGroups


class ShardedOptimizer(torch.optim.Optimizer, Joinable):
    """ZeRO-1 on top of a replicated `model`: ``ShardedOptimizer(model, torch.optim.AdamW, lr=..., ...)``, or
    with parameter groups as a torch optimizer takes them: ``ShardedOptimizer(model, torch.optim.AdamW,
    [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=...)``.

    A `torch.optim.Optimizer`: `param_groups` hold the model's parameters and are live (an LR scheduler,
    ``LambdaLR(opt, ...)``, or a loop writing ``group["lr"]`` changes the next step), `add_param_group` takes
    parameters of `model` not in a group yet. Each group's hyper-parameters apply to exactly its parameters,
    also where parameters of several groups share a bucket. ``step(closure=None)``,
    ``zero_grad(set_to_none=...)``, ``clip_grad_norm_(max_norm)`` (the global norm from the shard norms, one
    small all-reduce: use it, not ``torch.nn.utils.clip_grad_norm_``, which refuses the reduce-scattered
    `.grad`), ``state_dict()`` / ``load_state_dict()`` (per parameter: ``torch.distributed.checkpoint`` saves
    it and loads it on any world size).

    ``opt.optimizer`` is the torch optimizer that steps this rank's shards: one group per group of
    `param_groups` (their options copied at every step) over 1-D pieces of the flat parameter buffer (by
    tensor, over stand-ins of the whole parameters this rank owns); its ``state`` is the optimizer state, this
    one's stays empty. Loss scaling (float16): ``flatgrad.GradScaler`` (torch's own raises at ``step``).

    With main grads (``grad_dtype="float32"``, bfloat16/float16 parameters) the inner optimizer steps float32
    masters of this rank's shards, which `step()` rounds into the parameters and all-gathers in their dtype;
    they are saved with the state (key ``"master"``). See docs/mixed-precision.md.

    A tensor-parallel model (DTensor parameters, `replicate` over "dp"): each rank shards its local shards
    over "dp"; `clip_grad_norm_` adds the "tp" mesh's share; the state is saved in the whole parameters'
    shapes (by element) or as DTensors (by tensor); Muon orthogonalises each DTensor matrix.

    A `torch.distributed.algorithms.Joinable`, as ZeroRedundancyOptimizer: inside ``with Join([model, opt]):``
    (the model first) a rank out of data steps its shards with the others' averages and gathers along;
    `clip_grad_norm_` and a GradScaler's checks are not shadowed there (collectives it cannot foresee).

    Construction lays the model's parameters out again (flat parameter buffers, slots on multiples of the
    world size) and switches the model's buckets to reduce-scatter.

    Args:
        model: The model `flatgrad.replicate` was applied to, whose buckets are sharded; one ShardedOptimizer
            by element per model.
        optimizer_class: A `torch.optim.Optimizer` subclass: torch's element-wise ones (SGD, Adam, AdamW,
            Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop, Rprop, ASGD) shard by element, Muon and
            Adafactor by tensor; any other class as `shard_by` says or a probe shows (docs/data-parallel.md).
            LBFGS and SparseAdam are refused.
        params: Parameters of `model` or parameter groups (dicts with ``"params"`` and per-group options), as
            a torch optimizer's first argument; None (the default) puts every trainable parameter of `model`
            in one group. A parameter in no group is not stepped (its gradient is still averaged).
        overlap_param_gather: Whether `step()` returns with the parameter all-gathers in flight: the next
            forward waits for each bucket's just before the first module using its parameters runs
            (`flatgrad._gather_waits`), and the model's ``state_dict``/``load_state_dict`` and the next
            ``step()`` wait for all. Code that reads parameters outside a forward in between calls
            ``opt.wait_param_gather()`` first.
        shard_by: ``"element"`` (flat shards of every parameter: for optimizers whose update of an element
            reads that element only), ``"tensor"`` (whole parameters per rank, balanced by size: for
            optimizers that update each tensor as a whole, and any element-wise one), or None (the default):
            torch's classes their own way; another class by tensor where a probe on small tensors shows that
            exact, refused where it shows a statistic over several tensors. A declared value the probe
            contradicts is refused. By tensor, parameters frozen and unfrozen after construction (a GAN's
            ``toggle_optimizer``) are followed with nothing moved: a frozen parameter keeps its state and
            steps only with a `.grad`, as stock; a parameter frozen at construction and unfrozen later, and
            ``overlap_param_gather``, are not supported yet (refused); float32 masters
            (``grad_dtype="float32"``) are this rank's owned parameters'.
        **defaults: The optimizer's arguments (``lr``, ``weight_decay``, ...), checked by `optimizer_class`
            before anything moves: its error for an invalid one (a ValueError for a negative ``lr``, a
            TypeError for an unknown name) leaves `model` and the model as they were. The inner optimizer is
            built with them too, as a plain one would be: what a class reads from its constructor rather than
            its groups (Adagrad's ``initial_accumulator_value``, ``fused``) holds. ``differentiable=True`` is
            refused (a ValueError).

    Raises:
        TypeError: `model` is not replicated (`flatgrad.replicate`), `overlap_param_gather` is not a bool, or
            `optimizer_class` is not a `torch.optim.Optimizer` subclass.
        ValueError: `optimizer_class` cannot be sharded (cross-tensor, sparse) or not the way `shard_by` says;
            `model` already has a ShardedOptimizer it cannot share (by element: one per model; several by
            tensor may share it); `params` holds a tensor that is not a parameter of `model` (or one twice);
            parameters of different dtypes share a gradient buffer (float32 ones next to bfloat16 ones with
            main grads); or ``differentiable=True``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        *,
        overlap_param_gather: bool = False,
        shard_by: ShardBy | None = None,
        **defaults: Any,
    ) -> None:
        if not isinstance(model, ReplicateModule):
            raise TypeError(
                f"model must be one flatgrad.replicate was applied to, got a {type(model).__name__}"
            )
        dp = replicate_state(model)
        if not isinstance(overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be a bool, got {type(overlap_param_gather).__name__}")
        groups = as_groups([p for p in model.parameters() if p.requires_grad] if params is None else params)
        self._names = {id(p): name for name, p in model.named_parameters()}
        check_members(self._names, groups, "ShardedOptimizer's params must be parameters of its model")
        # Checked before anything moves: a typo raises here and leaves the model as it was.
        store = engine_of(dp.module).refresh()
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            given = getattr(optimizer_class, "__name__", optimizer_class)
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {given}")
        # The class's own error for a typo or a bad value first (before a probe would meet it).
        checked = checked_defaults(store, optimizer_class, groups, defaults)
        recipe = OptimizerRecipe(optimizer_class, dict(defaults))
        kind = shard_kind(recipe, shard_by, next(iter(store.buffers.values())))
        self.shard_by: ShardBy = agreed_kind(kind, store, dp.process_group)
        _check_companions(dp, self.shard_by, overlap_param_gather)
        self._ready = False  # the inner optimizer exists (add_param_group gives it a group too)
        super().__init__(groups, checked)
        Joinable.__init__(self)  # (not joined: Join configures it)
        self.dp = dp
        self.world_size = dp.world_size
        self.overlap_param_gather = overlap_param_gather
        # The class and the user's constructor arguments: every optimizer built here gets both.
        self._recipe = recipe
        # The whole state of parameters frozen since they were stepped, by name: restored when they are
        # trainable again (a plain optimizer keeps it, skipping them).
        self._parked: dict[str, dict[str, Any]] = {}
        self._held: tuple[tuple[int, ...], set[int]] = ((), set())  # (`_holds`)
        self._waits: weakref.finalize | None = None
        self._engine: ShardEngine | TensorEngine
        self._groups: PieceGroups | TensorGroups
        # Built on every rank's own pieces (by tensor: maybe none of a group's): a refusal raises everywhere.
        device = next(iter(store.buffers.values())).device
        build = functools.partial(self._lay_out_first, store)
        on_every_rank(build, "building the inner optimizer", device, dp.process_group)
        self._stepped_once = False  # (the first inner step is agreed as well)
        self._ready = True
        dp._engine.step_count = 0  # each synchronised backward checks the ranks agree on it

    def _lay_out_first(self, store: GradStore) -> None:
        if self.shard_by == "tensor":
            self._lay_out_by_tensor(store)
        else:  # slots on multiples of the world size: equal shards per bucket (and per buffer)
            self._lay_out(engine_of(self.dp.module).use_slot_multiple(self.world_size))

    def _inner_step(self, **kwargs: Any) -> Any:
        """The inner step; the first one's outcome agreed by every rank (`on_every_rank`): a class that fails
        on one rank's shard raises on every rank, not a hang."""
        if self._stepped_once:
            return self._groups.step(self.param_groups, **kwargs)
        step = functools.partial(self._groups.step, self.param_groups, **kwargs)
        loss = on_every_rank(step, f"{self._recipe.name}.step", self.join_device, self.dp.process_group)
        self._stepped_once = True
        return loss

    def _lay_out(self, store: GradStore) -> None:
        """Shard `store` (the model's gradient store, slots on multiples of the world size): dp's buckets
        reduce-scatter over it, the parameters become views of flat parameter buffers, and the inner optimizer
        steps this rank's pieces of `param_groups` (fresh: the caller loads its state)."""
        dp = self.dp
        pieces = dp._engine.shard_plan(store, self.overlap_param_gather)
        engine = ShardEngine(store, pieces, dp.process_group, dp._engine.policy)
        dp._engine.shards, store.scattered.gather = engine.grad_shards, engine.gather_grads
        MAIN_GRAD_GUARD.watch_sharded(store, self._holds)  # (another optimizer over the rest: refused)
        self._engine = engine
        self._groups = PieceGroups(engine, self._names, self._recipe, self.param_groups)
        if self._waits is not None:
            self._waits()  # (the hooks that waited for the old buckets' gathers)
        if self.overlap_param_gather:
            waits = ForwardWaits(engine, dp.module, dp._engine)
            self._waits = weakref.finalize(self, waits.remove)

    def _lay_out_by_tensor(self, store: GradStore) -> None:
        """Own whole parameters of `store` (`flatgrad._zero_tensor`): dp's buckets keep all-reducing, the
        parameters become views of flat parameter buffers (those of another ShardedOptimizer by tensor over
        dp, if any), and the inner optimizer steps the parameters of `param_groups` this rank owns."""
        members = {id(p) for group in self.param_groups for p in group["params"]}
        companion = self.dp._engine.step_count is not None  # (another ShardedOptimizer over dp)
        engine = TensorEngine(store, self.dp.process_group, members, companion)
        self._engine = engine
        self._groups = TensorGroups(engine, self._names, self._recipe, self.param_groups)

    def _follow_layout(self) -> None:
        """Before a step, a clip or a checkpoint: when parameters were frozen or unfrozen since the last
        layout, shard the new layout, every parameter keeping its optimizer state (a frozen one's is parked
        until it is trainable again), as a plain optimizer keeps a skipped parameter's; one collective per
        dtype gathers the state whole for the move (docs/data-parallel.md, "Freezing and unfreezing between
        steps"). A parameter frozen between a synchronised backward and its step keeps its slot and is
        stepped, as stock (`_engine._keeps_frozen`). By tensor nothing moves and nothing is communicated
        (`flatgrad._zero_tensor.TensorEngine.follow`).

        Raises:
            RuntimeError: The model's parameters changed otherwise (on every rank).
            ValueError: A group would hold parameters with different step counts
                (`flatgrad._zero.relaid_state`).
        """
        engine, grads = self._engine, engine_of(self.dp.module)
        if isinstance(engine, TensorEngine):  # (by tensor: (un)freezing moves nothing, `follow`)
            engine.check_layout(grads)
            return
        if not engine.params_in_place() or is_scattered(engine.store):
            engine.check_layout(grads)  # (raises if it changed)
            return
        with unguarded(engine.store, grads.store):
            store = grads.steady()
        if store is engine.store:
            return
        if any(id(p) not in self._names for p in store.params):  # (added or replaced)
            engine.check_layout(grads)
        assert isinstance(self._groups, PieceGroups), "by element: its pieces"
        old = self._groups.state_dict(self.param_groups)["state"]
        kept = whole_state(old, self.dp.process_group)
        frozen = [p for p in engine.store.params if p not in store]
        parked = {**self._parked, **{self._names[id(p)]: kept.pop(self._names[id(p)], {}) for p in frozen}}
        relaid_state(kept, parked, self._groups_on(store), self._recipe)  # (raises before any move)
        self._parked = parked
        with torch.no_grad():
            for param in frozen:  # (its memory its own again, not the old flat buffer's)
                move_into(param, local_of(param).clone())
        self._lay_out(store)
        assert isinstance(self._groups, PieceGroups), "by element: its pieces"
        views = self._groups.views(self.param_groups)
        saved = relaid_state(kept, self._parked, views, self._recipe)
        self._groups.load_state_dict(self.param_groups, saved)
        for name in saved["state"]:
            self._parked.pop(name, None)

    def _groups_on(self, store: GradStore) -> list[GroupView]:
        """The groups as the checkpoint sees them, over the parameters of `store`."""
        return [
            GroupView([(self._names[id(p)], p) for p in group["params"] if p in store], options(group), [])
            for group in self.param_groups
        ]

    # Steps the model's main grads through its float32 masters (see flatgrad._buffer.MainGradGuard).
    steps_main_grads = True
    # torch.amp.GradScaler hands this step its scale and inf flag (`grad_scale`, `found_inf` attributes)
    # instead of unscaling `.grad`, which holds no averaged value here.
    _step_supports_amp_scaling = True

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer that steps this rank's pieces (read-only)."""
        return self._groups.inner

    # --- the optimizer API ----------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of `dp`'s parameters (not in a group yet), with its own options, as torch's
        ``Optimizer.add_param_group``; the inner optimizer gets the matching group over this rank's pieces.

        Args:
            param_group: ``{"params": parameters of dp, **options}``; options not given take the defaults.

        Raises:
            ValueError: A parameter is not one of `dp`'s, is in a group already, or appears twice.
        """
        what = "ShardedOptimizer's param groups hold parameters of dp only"
        check_members(self._names, as_groups([param_group]), what)
        super().add_param_group(param_group)
        if self._ready:  # (torch's __init__ adds the first groups before the layout is made)
            self._groups.add(self.param_groups[-1], self.param_groups)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Update this rank's shards, then all-gather every bucket's parameters.

        As a torch optimizer's: `closure` runs first, under grad mode, and its loss is returned. When no
        parameter has a `.grad` (``zero_grad()`` and no backward since) nothing moves and nothing is
        communicated, as stock skips parameters without one.

        Args:
            closure: Optional; zeroes the gradients, runs forward and backward, and returns the loss.
            **kwargs: Passed on to the inner optimizer's ``step``, as torch's
                ZeroRedundancyOptimizer does (for an optimizer subclass whose step takes more).

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: The model's parameters changed (added, replaced, converted, or frozen between a
                synchronised backward and this step) since construction; or the inner optimizer's param_groups
                hold other tensors than exactly this rank's shards. (Parameters frozen or unfrozen otherwise
                are followed, `_follow_layout`.)
            ValueError: A parameter frozen or unfrozen since would share a group with parameters of another
                step count; or a group steps while a parameter of it has no gradient and its class cannot
                leave that one as it was (a step count per parameter: give such parameters their own group).
        """
        self._engine.wait_gather()  # (overlap_param_gather: a step with no forward since)
        self._check_join()
        if closure is not None and self._recipe.steps_with_closure:
            return self._step_around(closure, **kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_layout()
        self._groups.check(self.param_groups)
        self._engine.take_assigned_grads()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        self.dp._engine.stepped()  # (a step without gradients too)
        if self._engine.skip_or_unscale(found_inf, grad_scale) or not self._engine.has_grads():
            return loss
        self._inner_step(**kwargs)
        self._engine.launch_gather()
        if not self.overlap_param_gather:
            self._engine.wait_gather()
        return loss

    def _step_around(self, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """A step of a class that runs the closure inside its step (`OptimizerRecipe.steps_with_closure`):
        the closure it gets first sends every rank's moved shards to the others (the forward runs at the
        point the class chose, on every rank), then runs the user's closure and points the shards at the new
        gradients."""
        if self._engine.store.mains:
            raise NotImplementedError(
                f"ShardedOptimizer cannot step {self._recipe.name} with float32 masters (main "
                "grads of bfloat16/float16 parameters): its step runs the closure between "
                "moving the parameters and updating them; use its variant without a closure, "
                "or float32 parameters"
            )
        self._follow_layout()
        self._groups.check(self.param_groups)

        def inner_closure() -> Any:
            self._engine.launch_gather()
            self._engine.wait_gather()
            with torch.enable_grad():
                loss = closure()
            self._engine.take_assigned_grads()
            self._groups.point_grads()
            return loss

        self.dp._engine.stepped()
        loss = self._inner_step(closure=inner_closure, **kwargs)
        self._engine.launch_gather()
        if not self.overlap_param_gather:
            self._engine.wait_gather()
        return loss

    def train(self) -> None:
        """The inner optimizer's ``train()`` (schedule-free optimizers: the parameters move to the training
        point), then every rank's updated parameters reach the others.

        Raises:
            AttributeError: The optimizer class has no ``train()``.
        """
        self._call_inner("train")

    def eval(self) -> None:
        """The inner optimizer's ``eval()`` (schedule-free optimizers: the parameters move to the averaged
        point, for evaluation and checkpoints), then every rank's updated parameters reach the others.

        Raises:
            AttributeError: The optimizer class has no ``eval()``.
        """
        self._call_inner("eval")

    def _call_inner(self, name: str) -> None:
        if not callable(getattr(self.optimizer, name, None)):
            raise AttributeError(f"{self._recipe.name} has no {name}() for ShardedOptimizer to call")
        self._engine.wait_gather()
        self._follow_layout()
        if any(self._parked.values()):  # (by element; the same on every rank)
            raise ValueError(
                f"ShardedOptimizer: {name}() would leave the parameters frozen since they stepped "
                f"({sorted(k for k, v in self._parked.items() if v)}) where they are, where "
                f"{self._recipe.name}'s own moves every parameter it holds state for: use shard_by='tensor'"
            )
        self._groups.check(self.param_groups)
        self._groups.call(getattr(self.optimizer, name), self.param_groups)
        self._engine.launch_gather()
        self._engine.wait_gather()

    def unscale_shards_(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool) -> None:
        """What `flatgrad.GradScaler` runs for this optimizer: multiply this rank's gradient shards by
        `inv_scale` and set `found_inf` to 1.0 where any rank's shard holds an inf or NaN (one small
        all-reduce; every rank must call it), after following (un)freezing and assigned `.grad`s as `step`.

        Args:
            inv_scale: One over the loss scale (a 1-element float32 tensor).
            found_inf: Set to 1.0 where a gradient is not finite on some rank.
            allow_fp16: Whether float16 gradients may be unscaled (torch's argument).
        """
        self._follow_layout()
        self._engine.take_assigned_grads()  # (torch's scaler unscales a replaced `.grad` too)
        self._engine.unscale_(inv_scale, found_inf, allow_fp16)

    def _check_join(self) -> None:
        """Inside a `Join`, refuse an order the joined ranks could not follow: this optimizer steps after
        dp's shadowed backward, so dp must be in the same Join, before it."""
        joined, first = join_state(self)
        if joined and (first or not join_state(self.dp.module)[0]):
            leave_join(self)  # (the refusal ends the block: it must not outlive it)
            raise ValueError(
                "ShardedOptimizer inside a Join needs its model first in the same Join: "
                "Join([model, opt]) (a joined rank steps after the model's join hook shadowed a backward)"
            )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook through which a rank out of data steps with the others inside ``with Join([dp, opt]):``.

        Args:
            **kwargs: The Join's keyword arguments (for other joinables; none used here).

        Returns:
            The join hook.
        """
        return _ShardedJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where the Join's own all-reduces run: the replicated model's (`ReplicateModule.join_device`).

        Returns:
            The device of the model's gradients.
        """
        return self.dp.join_device

    @property
    def join_process_group(self) -> Any:
        """The group of dp, whose ranks share the shards.

        Returns:
            dp's `process_group` (None: the default group).
        """
        return self.dp.process_group

    def wait_param_gather(self) -> None:
        """Wait for the parameter all-gathers `step()` left in flight (``overlap_param_gather=True``); a no-op
        otherwise or once the forward waited."""
        self._engine.wait_gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model's gradients (`FlatGrad.zero_grad`) and drop the shards' `.grad`; afterwards a
        `.grad` is plain again (no longer reduce-scattered). By tensor (``shard_by="tensor"``), only this
        optimizer's parameters' gradients, as a torch optimizer's `zero_grad` (Muon's and AdamW's
        ShardedOptimizers over one model: one's zero_grad between the two steps leaves the other's gradients).

        Args:
            set_to_none: True sets every model `.grad` to None; False zeroes them in place.
        """
        if isinstance(self._engine, TensorEngine):
            torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)
            # (the model's gradient store now, not the layout's: (un)freezing lays it out again)
            store = engine_of(self.dp.module).current()
            with torch.no_grad():  # (main grads: zeroed, never None, as FlatGrad.zero_grad does)
                params = [p for group in self.param_groups for p in group["params"] if p in store]
                for param in params:
                    if store.is_main(param):
                        store.view(param).zero_()
                if set_to_none:
                    store.zeroed_to_none(params)
            self._groups.drop_grads()
            return
        # Unguarded: a layout change found by the zeroing moves the reduce-scattered `.grad`s (a clone each).
        with unguarded(self._engine.store, engine_of(self.dp.module).store):
            self.dp.module.zero_grad(set_to_none=set_to_none)  # (plain .grad again: it unmarks)
        # (and the store of the last layout, where (un)freezing laid the model out again since)
        unmark_scattered(self._engine.store, to_none=True)
        self.dp._engine.grads_cleared()
        self._groups.drop_grads()

    def _holds(self, param: torch.Tensor) -> bool:
        """Whether `param` is in a group (the ids are made again when a group changed)."""
        key = groups_key(self.param_groups)
        if self._held[0] != key:
            self._held = (key, {id(p) for group in self.param_groups for p in group["params"]})
        return id(param) in self._held[1]

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        pp_mesh: DeviceMesh | None = None,
    ) -> torch.Tensor:
        """Scale the gradient shards so that their global norm (over every rank's shards: the norm of the
        averaged gradients, as stock clipping computes it) is at most `max_norm`. One all-reduce of a scalar:
        every rank must call it.

        Args:
            max_norm: The largest global norm the gradients keep.
            norm_type: The order of the norm: positive, or ``float("inf")`` for the max norm.
            error_if_nonfinite: Raise instead of clipping when the global norm is NaN or infinite (on every
                rank: they share the norm), as torch's.
            foreach: Accepted for torch's signature; the shards are a few flat tensors, each scaled in one
                kernel either way.
            pp_mesh: The 1-D mesh of a pipeline's stages (``mesh["pp"]``), this model one stage of it: clip
                by the norm of every stage's gradients together (one scalar all-reduce more, over it; every
                stage must call it). None: by this model's.

        Returns:
            The global norm before clipping, as a 0-d tensor in at least float32.

        Raises:
            TypeError: `pp_mesh` is not a DeviceMesh.
            ValueError: `norm_type` is NaN, zero or negative (``-inf`` included: the minimum over shards
                would need another reduction, and nobody clips by it); `pp_mesh` is not 1-D, or crosses dp's
                group or the tensor-parallel mesh.
            RuntimeError: The global norm is non-finite and `error_if_nonfinite` is True.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:  # (False for NaN too)
            raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
        stages = None if pp_mesh is None else self._stages(pp_mesh)
        self._follow_layout()
        if isinstance(self._engine, TensorEngine):  # (every rank holds every averaged gradient)
            return self.dp.module.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite, pp_mesh=pp_mesh)
        self._engine.take_assigned_grads()  # (a `.grad` assigned by hand counts)
        return self._engine.clip(max_norm, norm_type, error_if_nonfinite, stages)

    def _stages(self, pp_mesh: DeviceMesh) -> dist.ProcessGroup:
        """`pp_mesh`'s group, checked against dp's group and the tensor-parallel mesh."""
        group = self.dp.process_group if self.dp.process_group is not None else dist.group.WORLD
        crossing = {"data-parallel": dist.get_process_group_ranks(group)}
        tensor_parallel = self._engine.store.tensor_parallel
        if tensor_parallel is not None:
            crossing["tensor-parallel"] = tensor_parallel.ranks
        return pipeline_group(pp_mesh, **crossing)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state per parameter, by plain parameter name, in a form independent of the world size
        (`flatgrad._zero_state`): per-element states are ShardedTensors over every rank's pieces (views of
        this rank's state), so ``torch.distributed.checkpoint`` saves ``{"optim": opt}`` in place and loads it
        on another world size or bucket size (every rank calls it together there; alone it communicates
        nothing). Group options a class's first step adds show before that step, marked not stepped yet.

        Returns:
            ``{"state": {name: {key: value}}, "param_groups": [{**options, "params": [names]}]}``
            (a group not stepped yet saves step counts of 0; a parameter frozen since it stepped, by element,
            its state whole, as a torch optimizer keeps it).

        Raises:
            ValueError: Not stepped yet, where the class's first step makes state under no parameter."""
        saved = self._groups.state_dict(self.param_groups)
        probes = [  # (what a first step adds to each group, and outside the parameters)
            first_step_keys(self._recipe, options(g), local_of(g["params"][0])) if g["params"] else None
            for g in self.param_groups
        ]
        added = [probe[0] if probe else () for probe in probes]
        saved["param_groups"] = with_stepped_options(saved["param_groups"], added)
        made = next(p[1] for p in probes if p is not None)  # (state kept under no parameter)
        if set(made) - saved[CLASS_STATE]["state"].keys():  # (the same on every rank)
            raise ValueError(
                f"{self._recipe.name}'s first step makes state outside its parameters ({list(made)}), which "
                "dcp.load into a ShardedOptimizer not stepped yet would restart: step it once first (lr=0, "
                "zero grads, as torch's get_state_dict does), or load each rank's own torch.save file"
            )
        parked = {name: state for name, state in self._parked.items() if state}
        if not parked:
            return saved
        groups = []  # (each group's names in its own order: the trainable ones and the frozen ones)
        for group, saved_group in zip(self.param_groups, saved["param_groups"]):
            listed = {*saved_group["params"], *parked}
            names = [self._names[id(p)] for p in group["params"]]
            groups.append({**saved_group, "params": [name for name in names if name in listed]})
        return {**saved, "state": {**saved["state"], **parked}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from `state_dict` (what `state_dict` gave, on any world size, through
        ``torch.distributed.checkpoint``; or this rank's own, ``torch.save``-d, on the same world size,
        buckets and shards). Checked on every rank together (one small all-reduce): a state that does not fit
        raises the same error on every rank, and none loads it. The groups' options are the saved ones after.

        Args:
            state_dict: A ShardedOptimizer `state_dict` of the same model and parameter groups.

        Raises:
            ValueError: On every rank, when any rank's `state_dict` is not a ShardedOptimizer state, has
                other parameter groups, or lacks state this rank needs (a file of another rank or world size
                loaded without torch.distributed.checkpoint), or would give a param group parameters with
                different step counts.
        """
        if isinstance(state_dict, dict) and "param_groups" in state_dict:
            state_dict = {**state_dict, "param_groups": without_stepped_options(state_dict["param_groups"])}
        self._engine.wait_gather()  # (overlap_param_gather: the parameters whole before any move)
        groups, state = self._groups, state_dict.get("state") if isinstance(state_dict, dict) else None
        entries = list(state.values()) if isinstance(state, dict) else [None]
        if self.dp.alive and not any(map(_holds_own_shards, entries)):  # (a rank's own file: into its layout)
            self._follow_layout()  # (all ranks load together: a freeze since the last layout first)
        if self._groups is not groups and all(
            isinstance(v, dict) for v in entries
        ):  # (cut by the old layout)
            state_dict = {**state_dict, "state": whole_state(state, self.dp.process_group)}  # type: ignore[arg-type]
        frozen = self._parked.keys() if isinstance(state_dict, dict) and "state" in state_dict else ()
        taken = {
            name: _whole(name, state_dict["state"][name]) for name in frozen if name in state_dict["state"]
        }
        if frozen:  # (by element: parameters frozen since they stepped keep their state whole)
            state_dict = {
                **state_dict,
                "state": {k: v for k, v in state_dict["state"].items() if k not in frozen},
                "param_groups": [
                    {**g, "params": [n for n in g.get("params", ()) if n not in frozen]}
                    for g in state_dict["param_groups"]
                ],
            }
        self._groups.load_state_dict(self.param_groups, state_dict)
        self._parked.update(taken)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank.

        Returns:
            The summed size of the tensors in the inner optimizer's state.
        """
        return state_bytes(self.optimizer)


def _holds_own_shards(entry: object) -> bool:
    """Whether a saved parameter state holds a rank's own shards (``torch.save``-d: not whole, not DCP's)."""
    return isinstance(entry, dict) and any(isinstance(v, dict) and SAVED_SHARDS in v for v in entry.values())


def _whole(name: str, state: dict[str, Any]) -> dict[str, Any]:
    """A saved state of a parameter frozen here, copied to be parked whole (not one saved sharded)."""
    if _holds_own_shards(state) or any(hasattr(v, "local_shards") for v in state.values()):
        raise ValueError(
            f"the saved state of {name!r}, frozen here, was saved sharded (this rank's own state, while it "
            "was trainable): load it with torch.distributed.checkpoint, or unfreeze it before loading"
        )
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()
    }


def _check_companions(dp: ReplicateState, shard_by: ShardBy, overlap_param_gather: bool) -> None:
    """Raise ValueError where `dp` already has a ShardedOptimizer this one cannot share it with (by element,
    dp's buckets reduce-scatter for that one's shards; several by tensor share dp: Muon's and AdamW's), or
    where ``shard_by="tensor"`` meets what it does not do yet (`overlap_param_gather`)."""
    has_one, by_element = dp._engine.step_count is not None, dp._engine.reduce_scatter
    if by_element or (has_one and shard_by == "element"):
        raise ValueError(
            "the model already has a ShardedOptimizer (its buckets are reduce-scattered for that "
            "one's shards); build one ShardedOptimizer per model, or several with "
            "shard_by='tensor' (Muon's and AdamW's: docs/data-parallel.md)"
        )
    if shard_by == "tensor" and overlap_param_gather:
        raise ValueError(
            "overlap_param_gather=True is not supported with shard_by='tensor' (whole "
            "parameters per rank) yet: leave it False"
        )


class _ShardedJoinHook(JoinHook):
    """What a rank that ran out of data does in place of the others' `step()`, as ZeroRedundancyOptimizer's
    join hook does: after each synchronised backward that dp's join hook shadowed (which left this rank the
    others' averages), step its shards and gather the parameters along (with the others'
    `overlap_param_gather`, left in flight as theirs)."""

    def __init__(self, opt: ShardedOptimizer) -> None:
        self.opt = opt
        super().__init__()

    def main_hook(self) -> None:
        """Step when dp's hook shadowed an averaging backward in this iteration."""
        if self.opt.dp._engine.shadowed_sync:
            self.opt.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """The Join is over: the optimizer is in none (torch's `Join` leaves the config it set on each
        joinable, so a Join whose body never stepped would leave the next `step` outside any Join refused)."""
        leave_join(self.opt)

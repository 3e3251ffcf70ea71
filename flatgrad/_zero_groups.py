"""A ShardedOptimizer's parameter groups over this rank's pieces (see `flatgrad.sharded`):
the optimizer's arguments checked, and `PieceGroups`, the inner torch optimizer with one
group per group of `param_groups` over 1-D pieces of the flat parameter buffer, kept in step
with them (options, membership, state per parameter)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flatgrad._checkpoint import (
    MASTER,
    STEP,
    GroupView,
    Piece,
    group_spec,
    load_group,
    misfit,
    optimizer_state,
    refuse_misfits,
    saved_stepped,
)
from flatgrad._zero import ShardEngine, parameter_dtypes
from flatgrad.buffer import GradStore

# Optimizers whose update of an element depends only on that element (and scalars): they
# give the same result on a shard as on the whole tensor.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def check_optimizer_class(optimizer_class: Any) -> None:
    """Raise ValueError unless `optimizer_class` is one of `ELEMENTWISE` (or a subclass)."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE)):
        names = ", ".join(cls.__name__ for cls in ELEMENTWISE)
        given = getattr(optimizer_class, "__name__", optimizer_class)
        raise ValueError(
            f"optimizer_class must be an element-wise torch optimizer ({names}) so that a "
            f"shard updates as the whole tensor would, got {given}"
        )


def check_members(names: dict[int, str], groups: list[dict[str, Any]], what: str) -> None:
    """Raise ValueError, "`what`, got a tensor ... that is not one", for a parameter of
    `groups` that is not in `names` (id -> name of dp's parameters)."""
    for group in groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"{what}, got a tensor of shape {tuple(param.shape)} that is not one")


def checked_defaults(
    store: GradStore,
    optimizer_class: type[torch.optim.Optimizer],
    groups: list[dict[str, Any]],
    defaults: dict[str, Any],
) -> dict[str, Any]:
    """`optimizer_class`'s defaults after it checked `defaults` and the groups' options on a
    one-element stand-in per group, before anything moves: its error for an invalid one (or
    a duplicate parameter) leaves the model as it was. Raises ValueError first for dtypes
    that no one flat parameter buffer holds (`parameter_dtypes`)."""
    parameter_dtypes(store)
    probe = next(iter(store.buffers.values()))
    dummies = [nn.Parameter(probe.new_zeros(1)) for _ in groups]
    checked = optimizer_class([dict(g, params=[d]) for g, d in zip(groups, dummies)], **defaults)
    return checked.defaults


def as_groups(params: Any) -> list[dict[str, Any]]:
    """A torch optimizer's first argument as a list of groups, each with a list of params."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of parameters or of parameter groups (dicts), got a "
            "single tensor; pass [tensor]"
        )
    params = list(params)
    if not params:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    if not isinstance(params[0], dict):
        params = [{"params": params}]
    groups = []
    for group in params:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(f"a parameter group must be a dict with 'params', got {type(group).__name__}")
        members = group["params"]
        members = [members] if isinstance(members, torch.Tensor) else list(members)
        for member in members:
            if not isinstance(member, torch.Tensor):
                raise TypeError(
                    "ShardedOptimizer can only optimize Tensors, but one of the params is "
                    f"{type(member).__name__}"
                )
        groups.append(dict(group, params=members))
    return groups


def options(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's options (everything but its parameters)."""
    return {key: value for key, value in group.items() if key != "params"}


def add_piece_group(
    add: Callable[[dict[str, Any]], None], pieces: Callable[[], set[int]], group: dict[str, Any]
) -> None:
    """The inner optimizer's `add_param_group`: only this rank's pieces may go in (torch's
    own checks the rest)."""
    params = group.get("params", ()) if isinstance(group, dict) else ()
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if any(id(p) not in pieces() for p in params):
        raise ValueError(
            "ShardedOptimizer's inner optimizer holds this rank's pieces of the flat shards only "
            "and cannot take model parameters (they are stepped through their shards already, "
            "and would be stepped twice); give them to ShardedOptimizer.add_param_group"
        )
    add(group)


def _with_saved_options(views: list[GroupView], state_dict: Any) -> list[GroupView]:
    """`views` with the options `state_dict` saved for each group over the current ones:
    they decide what state a group holds (SGD saved with momentum has momentum buffers that
    one built without it must load), as a torch optimizer loads whatever its dict holds.
    Unchanged where the saved groups do not match in number (`misfit` says why)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(views) or not all(isinstance(g, dict) for g in saved):
        return views
    return [
        dataclasses.replace(view, options={**view.options, **options(group)})
        for view, group in zip(views, saved)
    ]


def relaid_state(
    kept: dict[str, dict[str, Any]],
    parked: dict[str, dict[str, Any]],
    views: list[GroupView],
    optimizer_class: type[torch.optim.Optimizer],
) -> dict[str, Any]:
    """The state a new layout's groups (`views`) load after parameters were frozen or
    unfrozen: each parameter's own, whole (`kept`, of those in the layout before; `parked`,
    of those frozen since they last had one), a parameter that never had one a fresh one
    (zeros; its master is its value). Raises ValueError, on every rank alike (the step
    counts are the same everywhere), where a group would hold parameters with different
    step counts: torch's optimizers count steps per parameter, ShardedOptimizer's pieces
    per group."""
    state: dict[str, Any] = {}
    for index, view in enumerate(views):
        if not view.params:
            continue
        spec = group_spec(optimizer_class, view)
        entries = {name: kept.get(name) or parked.get(name) for name, _ in view.params}
        template = next((e for e in entries.values() if e is not None), None)
        steps = {
            name: float(entry[STEP]) if entry is not None else 0.0
            for name, entry in entries.items()
            if STEP in spec.scalars and (entry is None or STEP in entry)
        }
        if len(set(steps.values())) > 1:
            raise ValueError(
                f"ShardedOptimizer: after parameters were frozen or unfrozen, param group {index} "
                f"would hold parameters with different step counts ({steps}); "
                f"{optimizer_class.__name__} counts steps per parameter, ShardedOptimizer per "
                "group: give parameters that become trainable later a group of their own "
                "(build the optimizer without them and opt.add_param_group({'params': ...}) "
                "when unfreezing them), and keep a frozen parameter frozen or its group whole"
            )
        for name, param in view.params:
            entry = entries[name]
            if entry is None:
                entry = {
                    key: param.new_zeros(param.shape, dtype=_state_dtype(template, key, param))
                    for key in spec.per_element
                }
                if MASTER in spec.per_element:
                    entry[MASTER] = param.detach().float()
                if template is not None:
                    entry.update({key: template[key] for key in spec.scalars if key in template})
                elif STEP in spec.scalars:
                    entry[STEP] = torch.zeros((), dtype=torch.float32)
                    entry.update({key: value for key, value in spec.scalars.items() if key != STEP})
            state[name] = entry
    return {
        "state": state,
        "param_groups": [{**view.options, "params": [name for name, _ in view.params]} for view in views],
    }


def _state_dtype(template: dict[str, Any] | None, key: str, param: torch.Tensor) -> torch.dtype:
    value = template.get(key) if template is not None else None
    return value.dtype if isinstance(value, torch.Tensor) else param.dtype


class PieceGroups:
    """The inner optimizer (`inner`) over this rank's pieces of `param_groups` (a torch
    optimizer's groups of model parameters): one inner group per group, whose options it
    copies at every step. `names` maps id(param) to the plain parameter name (the
    checkpoint's keys). Every method that reads the groups is handed the live
    `param_groups` list."""

    def __init__(
        self,
        engine: ShardEngine,
        names: dict[int, str],
        optimizer_class: type[torch.optim.Optimizer],
        param_groups: list[dict[str, Any]],
    ) -> None:
        self.engine = engine
        self.names = names
        # Per group: this rank's pieces of its parameters (1-D views of the flat parameter
        # buffer) and the same pieces of the gradient buffer.
        self.pieces = [engine.pieces(group["params"]) for group in param_groups]
        inner_groups = [self.inner_group(group, pieces) for group, pieces in zip(param_groups, self.pieces)]
        self.inner = optimizer_class(inner_groups)  # type: ignore[call-arg]  # (an ELEMENTWISE one)
        # Model parameters given to the inner optimizer would be stepped twice (there and
        # through their shard): refused at the call. (An instance attribute: the optimizer
        # pickles and deep-copies by its state only.)
        self.inner.add_param_group = functools.partial(  # type: ignore[method-assign]
            add_piece_group, self.inner.add_param_group, self.piece_ids
        )
        self.held = self.signature(param_groups)

    def piece_ids(self) -> set[int]:
        return {id(piece.param) for pieces in self.pieces for piece in pieces}

    @staticmethod
    def inner_group(group: dict[str, Any], pieces: list[Piece]) -> dict[str, Any]:
        inner = options(group)
        inner["params"] = [piece.param for piece in pieces]
        return inner

    def add(self, group: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """The inner group for `group`, just added to `param_groups`."""
        pieces = self.engine.pieces(group["params"])
        self.pieces.append(pieces)
        torch.optim.Optimizer.add_param_group(self.inner, self.inner_group(group, pieces))
        self.held = self.signature(param_groups)

    def signature(self, param_groups: list[dict[str, Any]]) -> list[tuple[int, int]]:
        # The params lists themselves and their lengths: a list replaced or changed by hand
        # (past add_param_group) shows here, at no cost per parameter.
        groups = [*param_groups, *self.inner.param_groups]
        return [(id(group["params"]), len(group["params"])) for group in groups]

    def check(self, param_groups: list[dict[str, Any]]) -> None:
        """Raise RuntimeError where the groups (or the inner ones) were changed by hand: a
        parameter put into a group past add_param_group has no pieces, and one put into the
        inner optimizer would be stepped there and through its shard."""
        if self.signature(param_groups) != self.held:
            raise RuntimeError(
                "ShardedOptimizer's param_groups (and its inner optimizer's) were changed by "
                "hand: add parameters with opt.add_param_group, which gives them their pieces "
                "of this rank's shards; the inner optimizer holds those pieces only and cannot "
                "take model parameters (each is already stepped through its shard)"
            )

    def step(self, param_groups: list[dict[str, Any]], **kwargs: Any) -> None:
        """The inner optimizer's step over the pieces (through the float32 masters, if any),
        with the options `param_groups` hold now (live: what a scheduler or the loop wrote);
        what the step writes into its groups (an optimizer that adapts an option, or adds
        one) shows in `param_groups` afterwards, as it would in a plain optimizer's."""
        for pieces in self.pieces:
            for piece in pieces:
                piece.param.grad = piece.grad
        for group, inner in zip(param_groups, self.inner.param_groups):
            inner.update(options(group))
        self.engine.take_masters()
        self.inner.step(**kwargs)
        for group, inner in zip(param_groups, self.inner.param_groups):
            group.update(options(inner))
        self.engine.write_back()

    def drop_grads(self) -> None:
        """Drop the pieces' `.grad` (zero_grad)."""
        for pieces in self.pieces:
            for piece in pieces:
                piece.param.grad = None

    def views(self, param_groups: list[dict[str, Any]]) -> list[GroupView]:
        """Each group as the checkpoint sees it (`flatgrad._checkpoint.GroupView`)."""
        slots = self.engine.layout.slots
        return [
            GroupView(
                [(self.names[id(p)], p) for p in group["params"] if id(p) in slots],
                options(group),
                pieces,
                masters=self.engine.has_masters,
            )
            for group, pieces in zip(param_groups, self.pieces)
        ]

    def state_dict(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """The inner optimizer's state per parameter (`flatgrad._checkpoint.optimizer_state`)."""
        views = self.views(param_groups)
        return optimizer_state(self.inner, views, self.engine.layout, self.engine.process_group)

    def load_state_dict(self, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
        """Load `state_dict` into the inner optimizer and the groups' options, after every
        rank found it fits (`flatgrad._checkpoint.refuse_misfits`)."""
        views = _with_saved_options(self.views(param_groups), state_dict)
        layout = self.engine.layout
        problem = misfit(type(self.inner), views, layout, state_dict)
        refuse_misfits(problem, self.engine.shards[0].param.device, self.engine.process_group)
        stepped = saved_stepped(views, state_dict)
        for group, view, saved, flag in zip(param_groups, views, state_dict["param_groups"], stepped):
            group.update(options(saved))
            load_group(self.inner, view, layout, state_dict["state"], flag)

    def state_bytes(self) -> int:
        """The summed size of the tensors in the inner optimizer's state."""
        return sum(
            t.numel() * t.element_size()
            for state in self.inner.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )

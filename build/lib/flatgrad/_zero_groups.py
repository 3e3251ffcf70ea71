"""A ShardedOptimizer's parameter groups over this rank's pieces (see `flatgrad.sharded`):
the optimizer's arguments checked, and `PieceGroups`, the inner torch optimizer with one
group per group of `param_groups` over 1-D pieces of the flat parameter buffer, kept in step
with them (options, membership, state per parameter)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flatgrad._checkpoint import GroupView, Piece, load_group, misfit, optimizer_state, refuse_misfits
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
        self.stepped = [False] * len(param_groups)  # whether each group has state
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
        self.stepped.append(False)
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

    def step(self, param_groups: list[dict[str, Any]]) -> None:
        """The inner optimizer's step over the pieces (through the float32 masters, if any),
        with the options `param_groups` hold now (live: what a scheduler or the loop wrote)."""
        for pieces in self.pieces:
            for piece in pieces:
                piece.param.grad = piece.grad
        for group, inner in zip(param_groups, self.inner.param_groups):
            inner.update(options(group))
        self.engine.take_masters()
        self.inner.step()
        self.stepped = [True] * len(self.stepped)
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
        return optimizer_state(self.inner, views, self.stepped, self.engine.layout, self.engine.process_group)

    def load_state_dict(self, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> None:
        """Load `state_dict` into the inner optimizer and the groups' options, after every
        rank found it fits (`flatgrad._checkpoint.refuse_misfits`)."""
        views = self.views(param_groups)
        layout = self.engine.layout
        problem = misfit(type(self.inner), views, layout, state_dict)
        refuse_misfits(problem, self.engine.shards[0].param.device, self.engine.process_group)
        for group, view, saved, stepped in zip(
            param_groups, views, state_dict["param_groups"], state_dict["stepped"]
        ):
            group.update(options(saved))
            load_group(self.inner, view, layout, state_dict["state"], bool(stepped))
        self.stepped = [bool(flag) for flag in state_dict["stepped"]]

    def state_bytes(self) -> int:
        """The summed size of the tensors in the inner optimizer's state."""
        return sum(
            t.numel() * t.element_size()
            for state in self.inner.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor)
        )

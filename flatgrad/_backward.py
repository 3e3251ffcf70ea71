"""The backward coordinator, and seating.

A training forward through `FlatGrad` ends with `watch(output, plan)`: one prehook per output node, bound to a
`ForwardPlan` (the seater, whether a DDP reducer places the gradients, a `replicate`'s bucket sync). When a
backward first reaches one, the prehook asks the seater (`Seater.pre_backward`), then the bucket sync
(`BucketSync.pre_backward`), to open it, once per graph task; their ends run as one final callback in the same
order. Seating lands the gradients of parameters no routed Function writes in their slots, with stock's
`.grad` None-ness: small ones *seated* (`.grad` is the slot as the backward starts), large ones *placed* (a
pre-hook on their AccumulateGrad copies the gradient in), main grads through a post-accumulate-grad hook.
Step by step: docs/design.md, "One backward, step by step" and "Seated and placed parameters";
docs/mixed-precision.md, "How each gradient gets there"."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from flatgrad._buffer import GradStore
from flatgrad._comm import DDPEdge
from flatgrad._torch_compat import (
    POST_ACCUMULATE_HOOKS_NEED_A_GRADIENT,
    accumulate_grad_node,
    graph_task_id,
    queue_callback,
    run_post_accumulate_hooks,
    tree_leaves,
)

# What an autograd node hook is given: gradients (its inputs', its outputs').
Grads = tuple[torch.Tensor | None, ...]


class Participant(Protocol):
    """What the coordinator asks of a participant (a `Seater`, a `flatgrad._bucket_sync.BucketSync`) when a
    backward first reaches a forward's output: what to run at that backward's end, or None."""

    def pre_backward(self, flag: bool, /) -> Callable[[], None] | None: ...


class Layouts(Protocol):
    """What a `Seater` asks of its engine (`flatgrad._engine.GradEngine`, which sits above this module):
    whether a DDP forward came since the last backward, and a seater over a new layout after a conversion."""

    ddp: DDPEdge

    def rebuilt_seater(self) -> Seater: ...

    def check_layout(self) -> None: ...


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward decided for the backward through its output."""

    seater: Seater | None  # the seater of the layout the forward ran on (None before any)
    alone: bool  # no DDP reducer places this backward's gradients: seat the unrouted slots
    bucket_sync: Participant | None = None  # the `BucketSync` of the replicate that made the forward
    sync: bool = False  # whether that forward synchronised (outside no_sync)


def watch(output: object, plan: ForwardPlan) -> None:
    """Hook each autograd node that made `output` (see `output_nodes`) with a prehook bound to `plan`."""
    hook = functools.partial(_on_backward, plan)
    for node in output_nodes(output):
        node.register_prehook(hook)


def _on_backward(plan: ForwardPlan, grad_outputs: Grads) -> None:
    pairs = ((plan.seater, plan.alone), (plan.bucket_sync, plan.sync))  # (the seater first)
    ends = [end for who, flag in pairs if who is not None and (end := who.pre_backward(flag)) is not None]
    if ends:
        queue_callback(functools.partial(_finish, tuple(ends)))


def _finish(ends: tuple[Callable[[], None], ...]) -> None:
    for end in ends:
        end()


# Unrouted parameters smaller than this are seated (a fill + AccumulateGrad's add, no Python per parameter),
# larger ones placed. On CPU the hook costs more than the extra pass up to about this size (the GPT bench's
# twelve 65536-element projections seated: 0.3% off its backward, 4 runs); GPU passes are cheaper still.
SEAT_MAX_NUMEL = 1 << 17


class Seater:
    """Points `.grad` of the unrouted parameters at their zeroed slots when a backward through the model's
    output starts, and puts back None where that backward delivered nothing (from an autograd final callback;
    `_raised` if the backward raises), so `.grad` is None exactly where stock has it: a prehook per output
    node, a fill and a loop, not a hook per parameter. A gradient that comes past the model's output lands
    outside the buffer, and the next norm or sync moves it in."""

    def __init__(
        self, store: GradStore, params: list[nn.Parameter], routed: set[int], engine: Layouts
    ) -> None:
        self.store = store
        # Main grads: routed ones are written by their Functions, the others' gradients
        # are added in by `_absorb_incoming`; none is seated, placed or taken in.
        params = [p for p in params if not store.is_main(p)]
        unrouted = [p for p in params if id(p) not in routed]
        self.params = tuple(p for p in unrouted if p.numel() < SEAT_MAX_NUMEL)  # seated ones
        # Large ones (a conv, an attention projection): placed, one copy by a pre-hook on AccumulateGrad.
        self._placed = tuple(p for p in unrouted if p.numel() >= SEAT_MAX_NUMEL)
        self.routed = tuple(p for p in params if id(p) in routed)  # their layers' Functions write the slots
        self._owner = weakref.ref(engine)  # the GradEngine that lays out again
        self._task: int | None = None  # the graph task of the last backward it opened
        self._end: Any = None  # (weakly) that backward's end, which `_raised` follows
        self._retired = False
        self._accumulators: list[Any] = []  # a parameter holds its AccumulateGrad node weakly
        self.hooks: list[Any] = []  # removed by `retire`, or with the model (GradEngine)
        if POST_ACCUMULATE_HOOKS_NEED_A_GRADIENT:
            # torch 2.4 calls no post-accumulate-grad hook where no gradient reaches AccumulateGrad,
            # which is where a routed Function, a gather or `_place_incoming` wrote the slot
            # instead: run them as later releases do (`_torch_compat`), first on the node.
            for param in store.params:
                node = self._accumulator(param)
                self.hooks.append(node.register_hook(functools.partial(run_post_accumulate_hooks, param)))
        for param in self._placed:
            self._hook(_place_incoming, param)
        for param in self.routed:
            self._hook(_read_elsewhere, param)
        for param in store.mains:
            hook = functools.partial(_absorb_incoming, store, store.views[id(param)])
            self.hooks.append(param.register_post_accumulate_grad_hook(hook))

    def _hook(self, hook: Callable[[GradStore, nn.Parameter, Grads], Any], param: nn.Parameter) -> None:
        node = self._accumulator(param)
        self.hooks.append(node.register_prehook(functools.partial(hook, self.store, param)))

    def _accumulator(self, param: nn.Parameter) -> Any:
        """`param`'s AccumulateGrad node, kept alive with this seater (its hooks with it)."""
        node = accumulate_grad_node(param)
        self._accumulators.append(node)
        return node

    def retire(self) -> None:
        self._retired = True
        for handle in self.hooks:  # a graph still alive must not write into old buffers
            handle.remove()
        self._accumulators.clear()  # (``p.data`` of another shape keeps a node made before)

    def pre_backward(self, alone: bool) -> Callable[[], None] | None:
        """When a backward first reaches the output of a forward on this layout (from the coordinator,
        `flatgrad._backward`): seat the slots when `alone` (no DDP reducer places this backward's gradients:
        under a DDP its reducer copies them into its buckets) and return what settles `.grad` at its end; None
        for another output of the same backward, a create_graph backward, or a retired layout."""
        if self._retired or torch.is_grad_enabled():  # create_graph: grads stay differentiable
            return None
        if torch.compiler.is_compiling():
            return None  # compiled autograd traces this hook: see README
        task = graph_task_id()
        if task == self._task:
            return None  # another output of the same backward
        self._task = task
        engine = self._owner()
        if engine is not None:
            engine.check_layout()  # (a parameter replaced since: refused before anything moves)
        if engine is not None and engine.ddp.take_pending():
            # A DDP forward came since the last backward (this one may also reach the directly called model's
            # output): DDP's reducer places this backward's gradients, whichever output it reached first.
            alone = False
        store = self.store
        store.check(self.routed + self._placed + store.mains)  # the seated: by `seat`
        seated = [] if store.stale or not alone else store.seat(self.params)
        if store.stale and engine is not None:
            # A parameter was converted or reshaped since the layout (model.double(),
            # param.data = ...): lay out again now, before any gradient arrives.
            GradStore.unseat(seated)
            if store.seated is seated:
                store.seated = []
            seater = engine.rebuilt_seater()
            seater._task = task
            store = seater.store
            seated = store.seat(seater.params) if alone else []
        if not seated and (self._end is None or self._end() is None):  # (not nested: see `seat`)
            store.seated = seated  # (a use `node_target` seats joins it)
        store.begin_backward()
        end = functools.partial(self._after_backward, store, seated, alone)
        self._end = weakref.ref(end, functools.partial(_raised, store, seated))
        return end

    def _after_backward(
        self, store: GradStore, seated: list[tuple[torch.Tensor, torch.Tensor, int]], alone: bool
    ) -> None:
        GradStore.unseat(seated)
        if store.seated is seated:
            store.seated = []
        # A routed weight whose gradient came through plain autograd (its layer compiled, or read outside the
        # layer) got a tensor of its own: outside DDP it moves into the slot now (under DDP it is the
        # reducer's bucket view), and it is seated (or placed) like an unrouted one from then on.
        views = self.store.views
        bypassed = [p for p in self.routed if p.grad is not None and p.grad is not views[id(p)]]
        if bypassed and not self._retired:
            if alone and not self.store.stale:
                self.store.take_in(bypassed)
            self.params += tuple(p for p in bypassed if p.numel() < SEAT_MAX_NUMEL)
            for param in bypassed:
                if param.numel() >= SEAT_MAX_NUMEL:
                    self._placed += (param,)
                    self._hook(_place_incoming, param)
            self.routed = tuple(p for p in self.routed if p.grad is None or p.grad is views[id(p)])


def _raised(store: GradStore, seated: list[tuple[torch.Tensor, torch.Tensor, int]], _: object) -> None:
    """A backward's end is gone (the engine held it), unrun if it raised: unseat its leavings."""
    if store.seated is seated and seated:
        GradStore.unseat(seated)
        store.seated = []


def _place_incoming(
    store: GradStore, param: nn.Parameter, grads: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor | None, ...] | None:
    """AccumulateGrad pre-hook of a large unrouted parameter: when `.grad` is None, copy the incoming gradient
    into the slot, make the slot the `.grad`, and hand AccumulateGrad nothing to do (its post hooks, DDP's
    among them, still run). When `.grad` is defined AccumulateGrad adds in place into it, which is the slot.
    Under create_graph=True the gradient must stay differentiable: left alone."""
    grad = grads[0]
    if grad is None or param.grad is not None or torch.is_grad_enabled() or not param.requires_grad:
        return None  # (frozen since the forward: AccumulateGrad skips it, as stock's does)
    if store.view(param).shape != grad.shape:
        store.stale = True  # reshaped since the layout: AccumulateGrad takes it as stock does
        return None
    store.place(param, grad)
    return (None,)


def _read_elsewhere(store: GradStore, param: nn.Parameter, grads: Grads) -> None:
    """AccumulateGrad pre-hook of a routed weight: a gradient its layers did not return comes
    from a read outside them (``F.linear(h, emb.weight)``): summed from the next backward on."""
    if grads[0] is None:  # (the common case: the layers wrote the slot and returned None)
        return
    if not (id(param) in store.summed or torch.is_grad_enabled() or store.stale or param._backward_hooks):
        store.read_elsewhere = store.read_elsewhere | {id(param)}  # (not what the layers return)


def _absorb_incoming(store: GradStore, main: torch.Tensor, param: torch.Tensor) -> None:
    """Post-accumulate-grad hook of a main-grad parameter no routed Function writes (or a routed one whose
    gradient came by plain autograd): add the `.grad` AccumulateGrad made to the float32 main grad, `.grad`
    back to None, so the next micro-batch's gradient is taken, not added, in low precision. Under
    create_graph=True `.grad` must stay differentiable: left alone (a norm or sync takes it in later)."""
    grad = param.grad
    if grad is None or torch.is_grad_enabled() or store.stale:
        return
    if grad.shape != main.shape:
        store.stale = True  # reshaped since the layout: the next step lays out again
        return
    main.add_(grad)  # (AccumulateGrad's own tensor: dense, no graph)
    param.grad = None
    store.unwritten.discard(id(param))


def output_nodes(output: object) -> set[Any]:
    """The autograd nodes that made the tensors of a model's output: a tensor, any pytree
    of them, and the fields of dataclass instances in it (a dataclass is one opaque pytree
    leaf unless registered, and models return them: output classes, loss records)."""
    if isinstance(output, torch.Tensor):
        return set() if output.grad_fn is None else {output.grad_fn}
    nodes = set()
    stack, seen = tree_leaves(output), set()
    while stack:
        leaf = stack.pop()
        if isinstance(leaf, torch.Tensor):
            if leaf.grad_fn is not None:
                nodes.add(leaf.grad_fn)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and id(leaf) not in seen:
            seen.add(id(leaf))
            stack.extend(tree_leaves([getattr(leaf, field.name) for field in dataclasses.fields(leaf)]))
    return nodes

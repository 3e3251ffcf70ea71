"""The autograd hooks of a `BucketSync`: `ReadyHooks`, through which it counts each parameter
ready, with the parameters a synchronised backward left unused (counted ready at the start
of a later backward that will not reach them); `Deferrals`, which carry the end of a nested
backward out to the backward around it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from flatgrad._buckets import Bucket, Round
from flatgrad._prescale import scale_incoming
from flatgrad._torch_compat import will_execute

# What a hook on a parameter's AccumulateGrad calls: (param, bucket, grad_inputs, grad_outputs).
OnReady = Callable[[nn.Parameter, Bucket, Any, Any], None]


class ReadyHooks:
    """One hook per parameter on its AccumulateGrad node (kept alive here: a parameter holds
    its node only weakly), and the parameters once unused, with their nodes and buckets."""

    def __init__(self) -> None:
        self.unused: dict[int, tuple[nn.Parameter, Any, Bucket]] = {}
        self._params: tuple[nn.Parameter, ...] = ()
        self._bucket_of: Mapping[int, Bucket] = {}
        self._handles: list[Any] = []  # per parameter, in `_params`' order
        self._scaling: list[Any] = []  # the routed parameters' (`scale_incoming`)
        self._nodes: list[Any] = []

    def remove(self) -> None:
        """Remove every hook (from outside any hook dispatch)."""
        for handle in self._handles + self._scaling:
            handle.remove()
        self._handles, self._nodes, self._scaling = [], [], []

    def scale_incoming(self, store: Any, seater: Any) -> None:
        """Hook the AccumulateGrad of each parameter `seater` routes (of `store`; none without
        one) to scale a gradient that reaches it through plain autograd (the weight also used
        outside its layer) by the store's prescale factor where its layer wrote the slot so
        scaled in this backward (`flatgrad._prescale.scale_incoming`)."""
        routed = seater.routed if seater is not None else ()
        store.prescale.hooked = {id(param) for param in routed}
        with torch.enable_grad():
            for param in routed:
                node: Any = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                self._scaling.append(
                    node.register_prehook(functools.partial(scale_incoming, store.prescale, param))
                )
                self._nodes.append(node)

    def hook(
        self, params: Sequence[nn.Parameter], bucket_of: Mapping[int, Bucket], on_ready: OnReady
    ) -> None:
        """Hook each of `params` (a new store's) to call ``on_ready(param, bucket, ...)``,
        after `remove`; nothing is known unused yet.

        Args:
            params: the store's parameters, in its order.
            bucket_of: each one's bucket, by ``id(param)``.
            on_ready: what each hook calls, with the parameter and its bucket first.
        """
        self._params, self._bucket_of, self.unused = tuple(params), bucket_of, {}
        with torch.enable_grad():
            for param in self._params:
                node: Any = param.view_as(param).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                bucket = bucket_of[id(param)]
                self._handles.append(node.register_hook(functools.partial(on_ready, param, bucket)))
                self._nodes.append(node)

    def will_accumulate(self) -> bool:
        """Whether the running backward accumulates into a parameter: not so for
        torch.autograd.grad, nor for backward(inputs=...) that names none of them."""
        try:
            return any(will_execute(node) for node in self._nodes)
        except RuntimeError:  # asked during torch.autograd.grad, which never accumulates
            return False

    def note_unused(self, round_: Round, last: Bucket | None) -> None:
        """After `round_`, a synchronised backward: note the parameters it left unused (no
        AccumulateGrad ran before its final callback) but those of `last`, the last bucket
        to launch once the order is learned, whose hooks count nothing."""
        counted = len(self._params) - (len(last.params) if last is not None else 0)
        if round_.counts_all and len(round_.ready) < counted:
            ready, unused = round_.ready, self.unused
            for param, node in zip(self._params, self._nodes):
                bucket = self._bucket_of[id(param)]
                if id(param) not in ready and id(param) not in unused and bucket is not last:
                    unused[id(param)] = (param, node, bucket)

    def skip_unreached(self, round_: Round) -> None:
        """Count ready the parameters once unused that this backward will not reach (the
        engine will not run their AccumulateGrad), so their buckets need not wait for the
        final callback. Only those once unused are asked: a parameter that only a nested
        backward reaches (a reentrant checkpoint), which the engine cannot see from here,
        was ready before the final callback of every backward that used it."""
        unused = self.unused.values()
        unreached = [(param, bucket) for param, node, bucket in unused if not will_execute(node)]
        if unreached:
            round_.skip(unreached)

    def stop_counting(self, last: Bucket, on_last_ready: Callable[[Any, Any], None]) -> None:
        """Hook the parameters of `last` (the last bucket to launch) with `on_last_ready`,
        which counts nothing; a parameter once unused there is not asked about either.
        (From a final callback, where removing a hook is safe.)"""
        for i, param in enumerate(self._params):
            if self._bucket_of[id(param)] is last:
                self._handles[i].remove()
                self._handles[i] = self._nodes[i].register_hook(on_last_ready)
                self.unused.pop(id(param), None)


class Deferrals:
    """Post hooks that carry a nested backward's end outward. A backward that ran inside a
    node of another one (a reentrant activation checkpoint recomputing its part of the
    graph) ends before that one, which may have gradients still to come: its end is the
    step's."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def defer(self, outer: Any, resume: Callable[[], None]) -> None:
        """Call `resume` from a post hook on `outer`, the node the nested backward ran in (it
        runs in the outer backward once the node returns), once: the node may run again
        (retain_graph) before the hook is removed."""
        pending = [True]

        def finish_outside(grad_inputs: Any, grad_outputs: Any) -> None:
            if pending:
                pending.clear()
                resume()

        self._handles.append(outer.register_hook(finish_outside))

    def forget(self) -> None:
        """Remove every hook (outside any hook dispatch: a final callback, a forward)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

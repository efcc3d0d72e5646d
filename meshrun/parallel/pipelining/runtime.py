"""`PipelineSchedule`: run one rank's action list, moving activations and gradients by p2p.

The runtime executes exactly the list of `Action` it was given for this rank
(``schedule.pipeline_order[rank]``, checked by `validate_schedule` at construction); the named
schedules (`ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B`) only choose the lists.
After a step, ``schedule.last_actions`` is what this rank ran, for tests and debugging.

One step (``step(*args, target=..., losses=[])``):

- Microbatches: every tensor argument (and ``target``) is split along dim 0 into
  ``n_microbatches`` equal chunks (the batch size must divide evenly); other arguments go to
  every microbatch. Outputs of the last stage are concatenated back along dim 0.
- Loss: ``loss_fn(output, target)`` per microbatch on the last stage. Backward starts from
  ``loss / n_microbatches``: with a mean-reduced ``loss_fn`` and equal microbatches, the mean
  of the microbatch means is the mean over the whole batch, so gradients equal those of the
  unsplit model on the whole batch (``scale_grads=False``: the sum of the microbatch losses,
  as torch's flag of that name). ``losses`` receives the unscaled per-microbatch losses.
- ``F(s, m)``: receive the activation from stage s-1 (stage 0: the microbatch), run the
  stage, send the output to stage s+1 (last stage: the loss). ``B(s, m)``: receive the
  gradient of the output from stage s+1 (last stage: start from the loss), backward, send the
  gradient of the input to stage s-1. Floating-point tensors carry gradients; integer ones
  travel forward only. Neighbouring stages on one rank hand tensors over without a message.
- Split backward (a stage whose actions include ``W``; see `split_backward`): ``B(s, m)``
  computes only the input gradient (``autograd.grad`` w.r.t. the stage input, the graph
  retained) and sends it; ``W(s, m)`` later accumulates the parameters' gradients into
  ``.grad`` from the gradients B kept at the layers that use them, and frees the graph.

Point-to-point (c10d ``isend``/``irecv``, one tag per message so gloo matches by tag):

- Sends never block: ``isend`` is issued after the action and its handle is only polled (to
  free buffers) until the end of the step, where every send is waited. Hence two neighbouring
  stages can never both wait to send; the only waits are receives, and the validator has
  proved that each of them is satisfied (rule 5 of `validate`). Receives for the next
  ``RECV_AHEAD`` actions are posted, in action order, before the current one computes, so the
  transfer overlaps the compute and a sender usually finds its receive already posted: gloo
  then writes the payload at once from the sending thread, instead of waiting for the
  receiver's request to reach the sender's communication thread (which, on CPUs busy
  computing, waits for a core). The cost: up to ``RECV_AHEAD`` receive buffers (one
  microbatch's boundary tensors each) allocated ahead. It matters most for interleaved 1F1B,
  which sends twice as many messages (benchmarks/pp.py reports the per-step overhead).
- Shapes are found once, then fixed (as in torch.distributed.pipelining): in the first
  `step` (and, separately, the first `eval`) the first activation a stage receives is preceded
  by a small int64 header (count, dtype, shape of each tensor), checked against the stage's
  ``input_args`` where it has them; from then on both ends know the shapes, so every receive
  is posted ahead with the right buffers and no header is sent. Posting ahead matters: gloo
  writes a payload only once its receive is posted, and a receive posted late needs the
  sender's communication thread, which must first get a core from the sender's compute (on
  the pipeline's critical path when the CPUs are busy). A sender whose shapes differ from
  those fixed (another batch size, another sequence length, or microbatches of one step that
  differ) raises an error naming the stages before it sends anything, so no receive is ever
  written with a wrongly sized payload (gloo aborts the receiving process then). Gradients
  have the shapes of the outputs the receiver sent. A stage whose forward fails raises an
  error naming the stage, the microbatch and the shapes it received.

Data parallelism beside the pipeline: a stage module with ``no_sync()`` (meshrun's ``ddp``)
runs backward inside it for every microbatch but the last, and one with
``set_requires_gradient_sync`` (FSDP-style) is switched off then on, so gradients are
synchronised once per step, on the last microbatch. Under a split backward (zero-bubble) the
weight gradients come from the W's, each one autograd call per group of layers, and the last
of them may run long after the last B: with ddp on a stage module every W accumulates inside
``no_sync`` and, after that stage's last W of the step, one backward that adds zero to each
gradient lets ddp all-reduce the sums (`_synchronised_backward`), so the reduction waits for
the last W and runs once. A fully_shard stage module is switched to
``set_split_backward(True)`` at its B's (the end of B would otherwise free the unsharded
parameters that W still reads; each microbatch's are freed in its own W) and back after its
last W, leaving the user's ``set_reshard_after_backward`` as it was (an FSDP-style module
without that switch, such as torch's FSDP2, is switched through
``set_reshard_after_backward(False)``, then True); gradient sync is off for every W but the
stage's last, in which each unit reduce-scatters once (a W is one autograd call per unit: a
unit's layers share its gather). That last W runs inside the root's
``backward_in_parts()``, so its autograd calls are one backward for FSDP: an HSDP comm hook
sees one sequence of buckets and ``is_last()`` once per step (PowerSGD counts one step).
A step that fails drops what its backwards accumulated without sync in fully_shard units
(``discard_unsynced_gradients``).
These switches are checked at construction and at each training step (data parallelism may
be applied after the schedule is built); torch's ``DistributedDataParallel`` is refused (its
``no_sync`` acts on the forwards, which the pipeline runs ahead of their backwards).

Eval: ``eval(*args, target=None, losses=None)`` runs the forwards of the same order under
``torch.no_grad()`` (losses too when a target is given); nothing is kept for backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from meshrun._torch import tree_leaves
from meshrun.parallel._comm import launched, wait
from meshrun.parallel.grad_sync import gradient_sync
from meshrun.parallel.heartbeat import heartbeat
from meshrun.parallel.pipelining.actions import (
    BACKWARD,
    FORWARD,
    LOOP,
    WEIGHT,
    Action,
    Order,
    stage_rank,
)
from meshrun.parallel.pipelining.orders import forward_only
from meshrun.parallel.pipelining.simulate import split_stages
from meshrun.parallel.pipelining.split_backward import SplitBackward, backward_input
from meshrun.parallel.pipelining.stage import PipelineStage, as_tuple, tensor_meta
from meshrun.parallel.pipelining.validate import validate_schedule

MAX_TENSORS, MAX_DIMS = 8, 8  # per message between stages (the header has a fixed size)
HEADER_LEN = 1 + MAX_TENSORS * (2 + MAX_DIMS)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
TAG_SLOTS = 1 + MAX_TENSORS  # per message: slot 0 the header, 1..MAX_TENSORS the payload
RECV_AHEAD = 3  # actions whose receives are posted before the current action computes


class PipelineSchedule:
    """Run a validated action list (``order``) on this rank's stages, one step at a time.

    Args:
        stages: this rank's `PipelineStage` objects (one, or several for interleaving), all
            in the same pipeline group, and exactly the stages the order runs on this rank.
        n_microbatches: microbatches per step; the batch size must be a multiple of it.
        loss_fn: ``loss_fn(output, target) -> scalar``, mean-reduced over the microbatch,
            applied on the last stage; needed by `step`, optional for `eval`.
        order: pipeline rank -> list of `Action`, for every rank of the group.
        scale_grads: divide the loss by ``n_microbatches`` before backward (default), so
            gradients equal the unsplit model's with a mean-reduced loss over the batch.

    Raises:
        ScheduleError: the order fails `validate_schedule` (a ValueError).
        ValueError: no stages, stages from different groups, stage counts or placements, or
            stages that differ from those the order runs on this rank.
        NotImplementedError: a "v" placement on a backend other than gloo (see `validate`,
            rule 6); a stage under torch's DistributedDataParallel (use meshrun's ddp); a
            split backward (W actions) on a stage with ddp on a submodule only, or FSDP-style
            sync without ``set_reshard_after_backward`` on the stage module, or selective
            activation checkpointing inside it (also raised by `step` when data parallelism
            or checkpointing was applied after the schedule was built).

    Attributes:
        pipeline_order: the validated order of every rank (``dict[int, list[Action]]``).
        last_actions: the actions this rank ran in its last `step` or `eval`, in order.

    Mirrors torch's ``PipelineScheduleMulti`` / ``_PipelineScheduleRuntime`` (a schedule
    defined by its ``pipeline_order`` table).
    """

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *, order: Order, scale_grads: bool = True):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stages:
            raise ValueError("PipelineSchedule: give at least one PipelineStage")
        head = stages[0]
        for st in stages[1:]:
            if (st.num_stages, st.group_size, st.group_rank, st.placement) != (
                    head.num_stages, head.group_size, head.group_rank, head.placement
            ) or st.group is not head.group:
                raise ValueError(f"PipelineSchedule: {st} and {head} are not stages of the "
                                 f"same pipeline (same group, num_stages and placement)")
        self.num_stages, self.rank, self.num_ranks = (head.num_stages, head.group_rank,
                                                      head.group_size)
        self.group = head.group
        self.placement = head.placement
        if (self.placement != LOOP and self.num_ranks > 1
                and dist.get_backend(self.group) != "gloo"):
            raise NotImplementedError(
                f"PipelineSchedule: the {self.placement!r} placement interleaves activations "
                f"and gradients differently at the two ends of a channel, which only a "
                f"backend matching messages by tag handles; use gloo (got "
                f"{dist.get_backend(self.group)})")
        if len(order) != self.num_ranks:
            raise ValueError(f"PipelineSchedule: the order has {len(order)} ranks but the "
                             f"pipeline group has {self.num_ranks}")
        validate_schedule(order, self.num_stages, n_microbatches, placement=self.placement)
        eval_order = forward_only(order)
        validate_schedule(eval_order, self.num_stages, n_microbatches, backward=False,
                          placement=self.placement)
        mine = sorted({a.stage for a in order[self.rank]})
        given = sorted(st.stage_index for st in stages)
        if mine != given:
            raise ValueError(f"PipelineSchedule: the order runs stages {mine} on pipeline rank "
                             f"{self.rank}, but this rank built stages {given}")
        self.stages = stages
        self._n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.pipeline_order: Order = order
        self.last_actions: list[Action] = []
        self._eval_order = eval_order
        self._by_index = {st.stage_index: st for st in stages}
        self._split = split_stages(order)  # stages whose backward is B then W
        self._check_stage_modules()
        # the fixed shapes of each channel between ranks, per mode (training step, eval):
        self._sent_meta: dict[tuple[bool, int], list] = {}  # (training, destination stage)
        self._recv_meta: dict[tuple[bool, int], list] = {}  # (training, stage of this rank)
        self._batch_meta: dict[tuple[bool, str], list] = {}  # (training, "batch"/"target")
        self._failed = ""  # why a step failed midway: the schedule cannot run again

    @property
    def n_microbatches(self) -> int:
        """Microbatches per step (fixed: the order was built and checked for this number)."""
        return self._n_microbatches

    @n_microbatches.setter
    def n_microbatches(self, value) -> None:
        raise AttributeError(
            f"PipelineSchedule.n_microbatches is fixed at {self._n_microbatches}: the order "
            f"was built for it; build a new schedule (pipeline(..., n_microbatches={value}))")

    def _check_stage_modules(self) -> None:
        """Data parallelism the runtime can switch per microbatch. Not torch's
        DistributedDataParallel: its ``no_sync`` acts on the forwards run inside it, and the
        pipeline runs microbatch forwards ahead of their backwards (pp 2 x dp 2, 1F1B and
        ZB-H1: wrong gradients, no error). A stage whose backward is split (W actions)
        also needs ddp on the stage module itself and fully_shard with
        ``set_reshard_after_backward``. Checked at construction and again at each training
        step (data parallelism is often applied to the stage modules after the schedule is
        built, as the example does)."""
        for st in self.stages:
            if any(isinstance(m, torch.nn.parallel.DistributedDataParallel)
                   for m in st.submodule.modules()):
                raise NotImplementedError(
                    f"PipelineSchedule: stage {st.stage_index} is under torch's "
                    f"DistributedDataParallel, whose no_sync() must wrap the forward, but a "
                    f"pipeline runs microbatch forwards ahead of their backwards, so "
                    f"gradients would be synchronised wrongly; use meshrun.parallel.ddp on "
                    f"the stage module (or fully_shard)")
            if st.stage_index not in self._split:
                continue
            selective = [name or "the stage module" for name, m in st.submodule.named_modules()
                         if getattr(m, "_meshrun_ac_policy", "full") != "full"]
            if selective:
                raise NotImplementedError(
                    f"PipelineSchedule: stage {st.stage_index} has selective activation "
                    f"checkpointing ({', '.join(selective[:3])}), but its backward is split: "
                    f"B and W each run a backward through the checkpointed module, and "
                    f"torch's selective checkpoint allows one; use checkpoint_activations(..., "
                    f"'full') there, or a schedule without W actions")
            if _fsdp_style(st.submodule) and not hasattr(st.submodule,
                                                         "set_reshard_after_backward"):
                raise NotImplementedError(
                    f"PipelineSchedule: stage {st.stage_index} switches gradient sync like "
                    f"FSDP but has no set_reshard_after_backward on the stage module, which a "
                    f"split backward needs (the end of B must keep the unsharded parameters "
                    f"for W); apply meshrun's fully_shard to the stage module too (after its "
                    f"blocks), use ddp, or a schedule without W actions")
            if _ddp_style(st.submodule) and not hasattr(st.submodule, "no_sync"):
                raise NotImplementedError(
                    f"PipelineSchedule: stage {st.stage_index} has ddp on a submodule, not on "
                    f"the stage module itself; a split backward synchronises a stage module's "
                    f"ddp after its last W: apply ddp to the stage module")

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             **kwargs):
        """Forward and backward of one batch; gradients accumulate into ``.grad``.

        Args:
            *args, **kwargs: the batch, used on the rank holding stage 0 (ignored elsewhere,
                so every rank may pass it). Tensors are split along dim 0.
            target: the targets, used on the rank holding the last stage; split along dim 0.
            losses: if a list, the per-microbatch losses (detached) are appended to it on
                the last stage's rank.
            return_outputs: return the merged output on the last stage's rank.

        Returns:
            On the last stage's rank: the outputs of all microbatches concatenated along dim 0
            (a tuple if the stage returns a tuple; for any other type, such as a dict, the
            list of the microbatches' outputs). Elsewhere: None.

        Raises:
            ValueError: no ``loss_fn``; no ``target`` on the last stage's rank; a batch
                dimension not divisible by ``n_microbatches``; no batch on stage 0's rank.
            RuntimeError: a stage's forward failed, or shapes between stages do not match
                (the message names the stage and microbatch); this batch's (or target's)
                microbatch shapes differ from the first step's; an earlier step failed
                midway (the schedule cannot run again).

        Mirrors ``torch.distributed.pipelining``'s ``schedule.step``.
        """
        if self.loss_fn is None:
            raise ValueError("PipelineSchedule.step: training needs a loss_fn "
                             "(use eval() for forward only)")
        self._check_stage_modules()
        with torch.enable_grad():
            one = _Step(self, True, args, kwargs, target, losses, return_outputs)
            return self._run(one, self.pipeline_order[self.rank])

    def eval(self, *args, target=None, losses: list | None = None, **kwargs):
        """Forward only, under ``torch.no_grad()``: same arguments and result as `step`.

        With a ``target`` (and a ``loss_fn``) the per-microbatch losses are appended to
        ``losses`` on the last stage's rank. No gradient is computed or synchronised.
        """
        with torch.no_grad():
            one = _Step(self, False, args, kwargs, target, losses, True)
            return self._run(one, self._eval_order[self.rank])

    def _run(self, one: _Step, actions: list[Action]):
        """Run a step's actions; a step that fails midway leaves messages in flight between
        the ranks (a receive posted, a send unmatched) that would pair with the next step's,
        so the schedule refuses to run again (`_check_usable`). The stage modules' FSDP
        switches go back to what a finished step leaves (gradient sync on, reshard after
        backward on): a step that failed between B and W left them off, and the modules may
        outlive the schedule (an evaluation, a checkpoint, a plain backward). The gradients
        that its backwards without sync accumulated in fully_shard units (not ``.grad``,
        which ``zero_grad`` clears) are dropped: the next step on these modules (a new
        schedule, a plain backward) would add them to its own."""
        try:
            return one.run(actions)
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"[:300]
            for st in self.stages:
                module = st.submodule
                if hasattr(module, "set_requires_gradient_sync"):
                    module.set_requires_gradient_sync(True)
                for m in module.modules():  # meshrun's fully_shard units, wherever they are
                    if hasattr(m, "discard_unsynced_gradients"):
                        m.discard_unsynced_gradients(recurse=False)
                if st.stage_index in self._split and _fsdp_style(module):
                    _set_split(module, False)
            raise

    def _check_usable(self) -> None:
        if self._failed:
            raise RuntimeError(
                f"PipelineSchedule: an earlier step failed midway ({self._failed}); its "
                f"messages between the stages may still be in flight and would pair with "
                f"this step's, so this schedule cannot run again: let the job fail (meshrun "
                f"restarts it from the last checkpoint), or destroy and re-create the "
                f"process group and build a new schedule")


# -------------------------------------------------------------------------------------------
# one step: per-step state and the execution of the action list


class _Step:
    def __init__(self, schedule: PipelineSchedule, training, args, kwargs, target, losses,
                 return_outputs):
        schedule._check_usable()
        self.batch_meta: dict[tuple[bool, str], list] = {}  # what this step fixes, once run
        self.sched = schedule
        self.training = training
        self.losses = losses
        self.return_outputs = return_outputs
        m = schedule.n_microbatches
        by_index = schedule._by_index
        self.first = by_index.get(0)
        self.last = by_index.get(schedule.num_stages - 1)
        self.microbatches = None
        if self.first is not None:
            if not args and not kwargs:
                raise ValueError("PipelineSchedule: this rank holds stage 0 and needs the "
                                 "batch: step(inputs, target=...)")
            self.microbatches = _split_args(args, kwargs, m)
            first = [t for t in tree_leaves(self.microbatches[0]) if isinstance(t, torch.Tensor)]
            self._check_batch("batch", first)
        self.targets = None
        if self.last is not None:
            if target is None and training:
                raise ValueError(f"PipelineSchedule: this rank holds the last stage "
                                 f"({schedule.num_stages - 1}) and needs target=...")
            if target is not None and schedule.loss_fn is not None:
                self.targets = _split(target, m, "target")
                self._check_batch("target", [t for t in tree_leaves(self.targets[0])
                                             if isinstance(t, torch.Tensor)])  # fmt: skip
        self.cache: dict[tuple[int, int], tuple[list, list]] = {}
        self.weights: dict[tuple[int, int], SplitBackward] = {}  # B done, W not yet
        self.weights_done: dict[int, int] = {}  # stage -> W's run this step
        self.outputs: dict[int, object] = {}
        self.loss_values: dict[int, torch.Tensor] = {}
        self.local: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self.recvs: dict[Action, _Recv] = {}
        self.in_meta = {s: meta for (mode, s), meta in schedule._recv_meta.items()
                        if mode == training}  # stage -> shapes of its inputs, once known
        self.out_meta: dict[int, list] = {}  # stage -> meta of its outputs (microbatch 0)
        self.sends: list[tuple[dist.Work, list[torch.Tensor]]] = []

    def _check_batch(self, what: str, tensors: list[torch.Tensor]) -> None:
        """The first and last stages know the batch: one whose microbatch shapes differ from
        the first step's (or eval's) raises here, before this rank sends or receives anything,
        instead of leaving its peer waiting for a message of the old shape (only the stages in
        between cannot tell, and wait until the collective timeout or ``--hang-timeout``)."""
        key, meta = (self.training, what), tensor_meta(tensors)
        fixed = self.sched._batch_meta.get(key)
        if fixed is None:  # fixed once this step has run (a step refused here fixes nothing)
            self.batch_meta[key] = meta
        elif meta != fixed:
            raise RuntimeError(_fixed_shapes_message(
                f"this step's {what} microbatches are {_fmt(meta)}", meta, fixed, self.training))

    def run(self, actions: list[Action]):
        sched = self.sched
        sched.last_actions = []
        for i, action in enumerate(actions):
            inputs = self._wait_recv(action)
            for ahead in actions[i + 1:i + 1 + RECV_AHEAD]:  # overlap transfers with compute
                if not self._post_recv(ahead):
                    break  # shapes not known yet; keep posting in action order
            self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
            if action.kind == FORWARD:
                self._forward(action, inputs)
            elif action.kind == BACKWARD:
                self._backward(action, inputs)
            else:
                self._weight(action)
            sched.last_actions.append(action)
        for work, _ in self.sends:
            wait(work)
        self.sends = []
        heartbeat()  # one step done: progress for `meshrun --hang-timeout`
        for key, meta in self.batch_meta.items():
            sched._batch_meta.setdefault(key, meta)
        if self.last is None:
            return None
        m = sched.n_microbatches
        if self.losses is not None and self.loss_values:
            self.losses.extend(self.loss_values[i] for i in range(m))
        if not self.return_outputs:
            return None
        return _merge([self.outputs[i] for i in range(m)])

    # -- compute ----------------------------------------------------------------------------

    def _forward(self, action: Action, received):
        s, m = action.stage, action.microbatch
        stage = self.sched._by_index[s]
        if stage.is_first:
            args, kwargs = self.microbatches[m]
            inputs = []
        else:
            inputs = received
            if self.training:
                for x in inputs:
                    if x.is_floating_point():
                        x.requires_grad_(True)
            args, kwargs = tuple(inputs), {}
        output = stage.forward_one(m, args, kwargs)
        if stage.is_last:
            self.outputs[m] = _detach(output) if self.return_outputs else None
            if self.targets is not None:
                loss = self.sched.loss_fn(output, self.targets[m])
                self.loss_values[m] = loss.detach()
                if self.training:
                    self.cache[(s, m)] = (inputs, [loss])
            return
        outputs = list(as_tuple(output))
        self._check_outputs(stage, m, outputs)
        if self.training:
            self.cache[(s, m)] = (inputs, outputs)
        self._send(FORWARD, s + 1, m, [o.detach() for o in outputs])

    def _backward(self, action: Action, grads):
        s, m = action.stage, action.microbatch
        stage = self.sched._by_index[s]
        inputs, outputs = self.cache.pop((s, m))
        if stage.is_last:
            scale = 1.0 / self.sched.n_microbatches if self.sched.scale_grads else 1.0
            tensors, grad_tensors = outputs, [torch.full_like(outputs[0], scale)]
        else:
            floats = [o for o in outputs if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, grads, strict=True) if o.requires_grad]
            tensors, grad_tensors = [o for o, _ in pairs], [g for _, g in pairs]
        floats = [x for x in inputs if x.is_floating_point()]
        if s in self.sched._split:  # B now (the input gradient), W later
            if _fsdp_style(stage.submodule):  # keep the unsharded parameters for W
                _set_split(stage.submodule, True)
            params = [p for p in stage.submodule.parameters() if p.requires_grad]
            grads, self.weights[(s, m)] = backward_input(tensors, grad_tensors, floats, params)
        else:
            with gradient_sync(stage.submodule, m == self.sched.n_microbatches - 1):
                if tensors:
                    torch.autograd.backward(tensors, grad_tensors)
            grads = [x.grad for x in floats]
        if not stage.is_first:
            input_grads = [g if g is not None else torch.zeros_like(x)
                           for x, g in zip(floats, grads, strict=True)]
            self._send(BACKWARD, s - 1, m, input_grads)

    def _weight(self, action: Action):
        s, m = action.stage, action.microbatch
        module = self.sched._by_index[s].submodule
        self.weights_done[s] = self.weights_done.get(s, 0) + 1
        last = self.weights_done[s] == self.sched.n_microbatches  # the stage's last W
        if hasattr(module, "no_sync"):  # ddp: every W accumulates, then one synced backward
            with module.no_sync():
                self.weights.pop((s, m)).backward_weight()
            if last:
                _synchronised_backward(module)
            return
        # fully_shard: each unit reduce-scatters in the last W, whose autograd calls (one per
        # group of layers) are the parts of one backward: is_last() once for a comm hook
        parts = module.backward_in_parts() if last and hasattr(module, "backward_in_parts") \
            else contextlib.nullcontext()
        with gradient_sync(module, last), parts:
            self.weights.pop((s, m)).backward_weight()
        if last and _fsdp_style(module):
            _set_split(module, False)  # each W freed its microbatch's own

    def _check_outputs(self, stage: PipelineStage, m: int, outputs: list):
        bad = [type(o).__name__ for o in outputs if not isinstance(o, torch.Tensor)]
        if bad or not 1 <= len(outputs) <= MAX_TENSORS:
            raise RuntimeError(f"pipeline stage {stage.stage_index}: a stage before the last "
                               f"must return a tensor or a tuple of 1..{MAX_TENSORS} tensors "
                               f"(got {len(outputs)} values; non-tensors: {bad})")
        meta = tensor_meta(outputs)
        if stage.stage_index not in self.out_meta:
            for shape, _ in meta:
                if len(shape) > MAX_DIMS:
                    raise RuntimeError(f"pipeline stage {stage.stage_index}: outputs may have "
                                       f"at most {MAX_DIMS} dims (got shape {shape})")
            self.out_meta[stage.stage_index] = meta
        elif meta != self.out_meta[stage.stage_index]:
            raise RuntimeError(
                f"pipeline stage {stage.stage_index}: microbatch {m} produced outputs "
                f"{_fmt(meta)} but microbatch 0 produced {_fmt(self.out_meta[stage.stage_index])};"
                f" the microbatches of a step must have the same shapes between stages")

    # -- communication ----------------------------------------------------------------------

    def _peer(self, stage: int) -> int:
        return stage_rank(stage, self.sched.num_ranks, self.sched.placement)

    def _tag(self, kind: str, dst_stage: int, m: int, slot: int) -> int:
        direction = 1 if kind == BACKWARD else 0
        return ((dst_stage * 2 + direction) * self.sched.n_microbatches + m) * TAG_SLOTS + slot

    def _send(self, kind: str, dst_stage: int, m: int, tensors: list[torch.Tensor]):
        dst = self._peer(dst_stage)
        if dst == self.sched.rank:  # neighbour on this rank: hand over without a message
            self.local[(kind, dst_stage, m)] = tensors
            return
        tensors = [t.contiguous() for t in tensors]
        header = kind == FORWARD and self._check_fixed(dst_stage, tensors)
        if header:
            tensors = [_encode_header(tensors, tensors[0].device if tensors else None), *tensors]
        for slot, t in enumerate(tensors, start=0 if header else 1):
            work = launched(dist.isend(t, group=self.sched.group, group_dst=dst,
                                       tag=self._tag(kind, dst_stage, m, slot)))
            self.sends.append((work, [t]))

    def _check_fixed(self, dst_stage: int, tensors: list[torch.Tensor]) -> bool:
        """Whether this activation must carry the header (the channel's shapes are not fixed
        yet: it fixes them); raises if they were fixed with other shapes."""
        key, meta = (self.training, dst_stage), tensor_meta(tensors)
        fixed = self.sched._sent_meta.get(key)
        if fixed is None:
            self.sched._sent_meta[key] = meta
            return True
        if meta != fixed:
            raise RuntimeError(_fixed_shapes_message(
                f"pipeline stage {dst_stage - 1}: sends {_fmt(meta)} to stage {dst_stage}",
                meta, fixed, self.training))
        return False

    def _source(self, action: Action) -> int | None:
        """The stage whose message ``action`` needs, or None (stage 0 F, last stage B, W)."""
        if action.kind == WEIGHT:
            return None
        if action.kind == FORWARD:
            return action.stage - 1 if action.stage > 0 else None
        return action.stage + 1 if action.stage < self.sched.num_stages - 1 else None

    def _post_recv(self, action: Action) -> bool:
        """Post the receive ``action`` needs; False when its shapes are not known yet."""
        src_stage = self._source(action)
        if (src_stage is None or action in self.recvs
                or self._peer(src_stage) == self.sched.rank):
            return True
        s, m, kind = action.stage, action.microbatch, action.kind
        recv = _Recv(self._peer(src_stage))
        if kind == BACKWARD and s not in self.out_meta:
            return False  # shapes known once F(s, 0) has run: post later
        if kind == FORWARD and s not in self.in_meta:
            if m != 0:
                return False  # shapes unknown until microbatch 0's header arrives
            recv.header = torch.empty(HEADER_LEN, dtype=torch.int64,
                                      device=self.sched._by_index[s].device)
            recv.works.append(self._irecv(recv.header, recv.src, kind, s, m, 0))
        else:
            if kind == FORWARD:
                meta = self.in_meta[s]
            else:
                meta = [x for x in self.out_meta[s] if x[1].is_floating_point]
            self._post_payload(recv, meta, kind, s, m)
        self.recvs[action] = recv
        return True

    def _post_payload(self, recv: _Recv, meta, kind, s, m):
        device = self.sched._by_index[s].device
        recv.tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in meta]
        recv.works += [self._irecv(t, recv.src, kind, s, m, slot)
                       for slot, t in enumerate(recv.tensors, start=1)]

    def _irecv(self, tensor, src, kind, s, m, slot):
        return launched(dist.irecv(tensor, group=self.sched.group, group_src=src,
                                   tag=self._tag(kind, s, m, slot)))

    def _wait_recv(self, action: Action):
        src_stage = self._source(action)
        if src_stage is None:
            return None
        if self._peer(src_stage) == self.sched.rank:
            return self.local.pop((action.kind, action.stage, action.microbatch))
        if action not in self.recvs:
            self._post_recv(action)
        if action not in self.recvs:  # a later microbatch whose shapes come from microbatch 0
            raise RuntimeError(f"pipeline stage {action.stage}: {action} runs before the "
                               f"stage received microbatch 0")
        recv = self.recvs.pop(action)
        if recv.header is None:
            for work in recv.works:
                wait(work)
            return recv.tensors
        s = action.stage
        wait(recv.works[0])  # the header
        meta = _decode_header(recv.header)
        self._check_header(s, meta)
        self.in_meta[s] = self.sched._recv_meta[(self.training, s)] = meta  # fixed from now on
        recv.works = []
        self._post_payload(recv, meta, action.kind, s, action.microbatch)
        for work in recv.works:
            wait(work)
        return recv.tensors

    def _check_header(self, s: int, meta):
        expected = self.sched._by_index[s].input_meta
        if expected is not None and expected != meta:
            raise RuntimeError(
                f"pipeline stage {s} (pipeline rank {self.sched.rank}): stage {s - 1} sent "
                f"{_fmt(meta)}, but stage {s} was declared (input_args) to take "
                f"{_fmt(expected)}; fix the split so that stage {s - 1}'s output is stage "
                f"{s}'s input")


class _Recv:
    """A receive in flight: the header (first microbatch) and/or the payload buffers."""

    def __init__(self, src: int):
        self.src = src
        self.header: torch.Tensor | None = None
        self.tensors: list[torch.Tensor] = []
        self.works: list[dist.Work] = []


# -------------------------------------------------------------------------------------------
# helpers


def _fixed_shapes_message(now: str, meta, fixed, training: bool) -> str:
    """Why a step's shapes (``meta``, described by ``now``) cannot run where the first step
    (or eval) fixed ``fixed``: the dtypes when only they changed, else the shapes."""
    first = "step" if training else "eval"
    same_shapes = [shape for shape, _ in fixed] == [shape for shape, _ in meta]
    what = "dtypes" if same_shapes else "shapes"
    keep = ("keep the dtypes of what the stages return constant" if same_shapes else
            "keep the batch size and sequence length constant (e.g. drop_last=True)")
    return (f"{now}, but the first {first} had {_fmt(fixed)}; the {what} between stages are "
            f"fixed by the first step and the first eval (as in torch.distributed.pipelining):"
            f" {keep}, or build a new PipelineSchedule for other shapes")


def _synchronised_backward(module) -> None:
    """One backward that adds nothing to ``module``'s gradients but runs ddp's hooks in sync.

    Under a split backward a stage's W's each run one autograd call per group of layers
    (`split_backward`), while ddp's reducer expects every gradient of a synchronised step
    within one autograd call (its end-of-backward callback all-reduces). So every W runs in
    ``no_sync`` (gradients accumulate into ``.grad``) and, after the stage's last W, this
    backward from each parameter that has a gradient, with a zero gradient (a stride-0
    expanded scalar: no memory), makes ddp all-reduce the accumulated ``.grad``: the
    documented no_sync contract ("the next synchronised backward all-reduces the accumulated
    gradients"). Parameters without a gradient take no part, as in any backward, so ddp
    reports them (or ``find_unused_parameters`` handles them) as it would for 1F1B."""
    params = [p for p in module.parameters() if p.requires_grad and p.grad is not None]
    if params:
        torch.autograd.backward(params, [torch.zeros((), dtype=p.dtype, device=p.device)
                                         .expand_as(p) for p in params])


def _set_split(module, split: bool) -> None:
    """Keep (True) or stop keeping a stage module's unsharded parameters from B to W:
    meshrun's fully_shard has a switch for it that leaves the user's reshard_after_backward
    alone; another FSDP-style module (torch's FSDP2) is switched through that setting."""
    if hasattr(module, "set_split_backward"):
        module.set_split_backward(split)
    else:
        module.set_reshard_after_backward(not split)


def _fsdp_style(module) -> bool:
    """Whether ``module`` or a submodule switches sync like FSDP (fully_shard, torch FSDP2)."""
    return any(hasattr(m, "set_requires_gradient_sync") for m in module.modules())


def _ddp_style(module) -> bool:
    """Whether ``module`` or a submodule switches sync like DDP (meshrun's ddp, torch's DDP)."""
    return any(hasattr(m, "no_sync") for m in module.modules())


def _split(value, m: int, what: str):
    if not isinstance(value, torch.Tensor):
        return [value] * m
    if value.dim() == 0 or value.shape[0] % m or value.shape[0] == 0:
        size = value.shape[0] if value.dim() else "none (a scalar)"
        if size == 0:
            raise ValueError(f"PipelineSchedule: {what} is an empty batch (batch dimension 0)")
        raise ValueError(f"PipelineSchedule: {what} has batch dimension {size}, which is not "
                         f"a multiple of n_microbatches={m}")
    return list(value.split(value.shape[0] // m))


def _split_args(args: tuple, kwargs: dict, m: int) -> list[tuple[tuple, dict]]:
    per_arg = [_split(a, m, f"argument {i}") for i, a in enumerate(args)]
    per_kwarg = {k: _split(v, m, f"argument {k!r}") for k, v in kwargs.items()}
    return [(tuple(parts[i] for parts in per_arg), {k: v[i] for k, v in per_kwarg.items()})
            for i in range(m)]


def _merge(outputs: list):
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs) if outputs[0].dim() else torch.stack(outputs)
    if isinstance(outputs[0], tuple):
        return tuple(_merge(list(parts)) for parts in zip(*outputs, strict=True))
    return outputs


def _detach(output):
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, tuple):
        return tuple(_detach(o) for o in output)
    return output


def _encode_header(tensors: list[torch.Tensor], device) -> torch.Tensor:
    head = torch.zeros(HEADER_LEN, dtype=torch.int64)
    head[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in DTYPES:
            raise RuntimeError(f"pipeline: cannot send a tensor of dtype {t.dtype} between "
                               f"stages (supported: {', '.join(map(str, DTYPES))})")
        base = 1 + i * (2 + MAX_DIMS)
        head[base] = DTYPES.index(t.dtype)
        head[base + 1] = t.dim()
        head[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return head.to(device) if device is not None else head


def _decode_header(head: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    values = head.tolist()
    meta = []
    for i in range(values[0]):
        base = 1 + i * (2 + MAX_DIMS)
        ndim = values[base + 1]
        meta.append((tuple(values[base + 2:base + 2 + ndim]), DTYPES[values[base]]))
    return meta


def _fmt(meta) -> str:
    return "[" + ", ".join(f"{shape} {str(dtype).replace('torch.', '')}"
                           for shape, dtype in meta) + "]"

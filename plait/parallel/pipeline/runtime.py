"""``PipelineRunner``: executes this rank's list of a lowered schedule on real stages and real p2p messages.

Execution rule (docs/pipeline.md, "Lowering"): walk the rank's actions in order; post each run of consecutive
send/recv actions as one batched ``Comm.send_recv`` (asynchronous); before a compute action, wait for the
batch holding the recv it consumes; wait for every send before the step ends. ``lower`` orders the actions so
that this completes even if every send and recv blocked until its peer posted, so waiting for a whole batch
(its sends included) never deadlocks. Where the transport moves each message on its own (gloo), a run's
receives are posted ``RECV_LOOKAHEAD`` compute actions earlier, as their own batch, and its sends where they
were (``program.py``): every wait stays where it was, so the same argument holds.

Shapes and dtypes: a recv needs a buffer. The first step with a new micro-batch input shape runs a *shape
pass*: the stages, in order, run one no-grad forward (eval mode, RNG state restored, under the same autocast)
on zeros of the incoming shape and pass the output's (shape, dtype) to the next stage as a small int64
message. Results are cached per input (shape, dtype), so later steps exchange no metadata. Evaluation runs the
stages one after another on the whole batch, sending each tensor's metadata just before it.

Packed documents (``plait.models.inputs``): every rank of a pipeline holds the step's micro-batches, so each stage
gets its micro-batch's positions from there (``stage(x, positions=...)``), never through a stage hand-off: only the
activations cross a stage boundary, as without documents.

Loss: the last stage computes each micro-batch's loss under autocast as the step's ``StepLoss`` says (a token
total, or a mean) and differentiates ``precision.scale(loss.to_backward(j, value))`` (divided by the global
batch's token count, or by m: ``plait.parallel.loss_normalization``), so the accumulated gradients are those of
the loss over the global batch; the sum of the values is broadcast from the last stage over "pp", so every rank
returns the same value.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from plait.comm import Comm
from plait.comm.collectives import Pending
from plait.errors import ScheduleError
from plait.logging import get_logger
from plait.models.inputs import Inputs, split, tokens_of
from plait.parallel.loss_normalization import StepLoss
from plait.parallel.pipeline.overlap import run_pair
from plait.parallel.pipeline.program import Post, program
from plait.parallel.pipeline.schedule import Action, Kind, Schedule, lower
from plait.parallel.pipeline.simulate import simulate
from plait.parallel.pipeline.stage import PipelineStage
from plait.parallel.pipeline.tensor_meta import TensorMeta
from plait.parallel.precision import MixedPrecision
from plait.parallel.runner import Micro, NoSync, UpdateFn

logger = get_logger(__name__)

AXIS = "pp"
ParamScope = Callable[[int, str], contextlib.AbstractContextManager[None]]
_NO_SCOPE: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
"""Entered around each action when the strategy has no per-stage scope (reusable: it holds no state)."""


def check_schedule(schedule: Schedule) -> Schedule:
    """Validate and simulate ``schedule`` (ScheduleError on a malformed or deadlocking one); return it lowered."""
    simulate(schedule)
    return schedule if schedule.is_lowered else lower(schedule)


class PipelineRunner:
    """Runs ``schedule`` on this pp rank's ``stages`` (``Schedule.stages_on``: stage s on pp index s % p, or in a
    V), sending through ``comm``; a hand-over between two stages of this rank is local."""

    owns_updates = False
    """True for a runner that applies optimizer updates itself during the step (PipeDream); the Engine then
    leaves the step's gradients alone."""
    SENDS_BEFORE_COMPUTE = frozenset({"1f1b"})
    """Schedules whose ranks complete their posted sends before each compute action (``_finish_sends``): those
    ``torch.distributed.pipelining`` runs that way (its ``Schedule1F1B`` waits each fused send+receive batch; its
    GPipe and its runtime for interleaved and zero-bubble schedules wait sends only at the end of the step)."""
    OVERLAPPED_PAIRS = frozenset({"dualpipev"})
    """Schedules whose adjacent (forward, backward) pairs of two stages run overlapped (``overlap.py``)."""
    RECV_LOOKAHEAD = 2
    """Where the transport moves each message on its own (``Comm.p2p_progresses_independently``: gloo), each run
    of receives is posted this many compute actions before the lowering puts it (``program.program``): the bytes
    are read while this rank computes instead of after it asks. On the ``pp`` suite (2 CPU cores, gloo) GPipe
    went from 0.99 x torch's step rate to 1.07-1.13 x and 1F1B at pp=4 to 1.05-1.10 x; 1F1B at pp=2 stayed level
    at best (0.94-1.02 x); every schedule's measured bubble fell (docs/pipeline.md, "Posting receives ahead")."""
    tags_activations = False
    """True when every activation sent forward is followed, in the same batch, by a one-element int64 *tag*
    (PipeDream's vertical sync sends the first stage's weight version with each micro-batch): the sender puts
    it in the outbox as ("V", stage, microbatch); the receiver finds it in the inbox under the same key."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Schedule,
        comm: Comm,
        precision: MixedPrecision,
        *,
        no_sync: NoSync = contextlib.nullcontext,
        param_scope: ParamScope | None = None,
        input_checks: Sequence[Callable[[torch.Tensor], None]] = (),
    ) -> None:
        self.comm = comm
        self.mesh = comm.mesh
        self.precision = precision
        self.loss: StepLoss | None = None
        """The running step's loss normalisation (set by ``run``)."""
        self.no_sync = no_sync
        """The data-parallel strategy's ``no_sync``: every backward of a step accumulates locally; the Engine's
        update reduces the gradients once."""
        p, index = self.mesh.size(AXIS), self.mesh.index(AXIS)
        if schedule.p != p:
            raise ScheduleError(
                f"schedule {schedule.name!r} has p={schedule.p}, but the mesh has pp={p}. Fix: build it for p={p}."
            )
        self.schedule = schedule
        self.lowered = check_schedule(schedule)
        self.stages = {stage.index: stage for stage in stages}
        expected = schedule.stages_on(index)
        if sorted(self.stages) != expected:
            raise ScheduleError(
                f"pp rank {index} holds stages {sorted(self.stages)}, but the schedule places "
                f"{expected} there ({schedule.placement_rule})."
            )
        self.actions = self.lowered.actions[index]
        self.recv_lookahead = self.RECV_LOOKAHEAD if comm.p2p_progresses_independently(AXIS) else None
        self.sends_before_compute = schedule.name in self.SENDS_BEFORE_COMPUTE
        self.num_stages = schedule.num_stages
        self.last_rank_index = schedule.rank_of(self.num_stages - 1)
        self._metas: dict[tuple[tuple[int, ...], torch.dtype], dict[int, TensorMeta]] = {}
        self.timeline: list[tuple[Action, float, float]] = []
        """The last step's compute actions as (action, start, end) in ``time.perf_counter`` seconds."""
        self.step_start = 0.0
        self.step_end = 0.0
        self.tied = self._tied_copies()
        for stage in self.stages.values():
            stage.refresh_params()  # the tied copies are trainable now
        self._pp_ranks = self.mesh.ranks(AXIS)  # global ranks of this pp group: looked up once, not per action
        self.input_checks: tuple[Callable[[torch.Tensor], None], ...] = tuple(input_checks)
        """Called with each step's (and evaluation's) first-stage input on every rank before any message, so that
        an input the first stage would refuse fails on every rank alike (context parallelism: the sequence must
        split over cp), instead of leaving the later stages waiting for it."""
        self.overlap_pairs = (
            schedule.name in self.OVERLAPPED_PAIRS and self.recv_lookahead is not None and self.mesh.size("ep") > 1
        )
        """Run DualPipeV's steady-state pairs overlapped (``_pair_of``, ``overlap.py``): under expert parallelism
        (there is nothing to overlap otherwise), on a transport whose receives are posted ahead; under ZeRO-3 each
        action in its own stage's scope (``zero/fsdp_pipeline.py``). Settable (tests compare it with the pairs run
        in order)."""
        self.param_scope: ParamScope = param_scope or (lambda stage, kind: _NO_SCOPE)
        """Entered around each compute action of a stage and each no-grad forward of it (``(stage, kind)``; given
        by ``plait.parallelize`` as the data-parallel strategy's ``pipeline_scope``: ZeRO-3 gathers the stage's
        parameter units there and frees them after)."""

    # ----------------------------------------------------------------- helpers
    @property
    def recv_lookahead(self) -> int | None:
        """None: each run of transfers is posted as one batch where the lowering put it (any transport, NCCL
        included); an integer k: receives k compute actions ahead, as their own batches (gloo only). Setting it
        rebuilds ``program``."""
        return self._recv_lookahead

    @recv_lookahead.setter
    def recv_lookahead(self, value: int | None) -> None:
        self._recv_lookahead = value
        self.program: list[Action | Post] = program(self.actions, value)
        """This rank's compute actions and posts of transfer batches, in the order the step runs them."""

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    def _peer(self, stage: int) -> int:
        """Global rank holding ``stage`` in this rank's pp group."""
        return self._pp_ranks[self.schedule.rank_of(stage)]

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @contextlib.contextmanager
    def _mode(self, training: bool) -> Iterator[None]:
        """The local stages in train (or eval) mode for the block, their previous modes restored after. A stage
        whose module is already in that mode is left alone (no walk over its submodules, and a submodule the
        user put in the other mode stays there): ``Engine.train_step`` has just called ``model.train()``."""
        changed = [stage.module for stage in self.stages.values() if stage.module.training != training]
        for module in changed:
            module.train(training)
        try:
            yield
        finally:
            for module in changed:
                module.train(not training)

    def _send_meta_and(self, tensor: torch.Tensor | None, meta: TensorMeta, peer: int) -> None:
        self.comm.send_recv(sends=[(meta.encode(self.device), peer)], axis=AXIS)
        if tensor is not None:
            self.comm.send_recv(sends=[(tensor.contiguous(), peer)], axis=AXIS)

    def _recv_meta(self, peer: int) -> TensorMeta:
        message = TensorMeta.message(self.device)
        self.comm.send_recv(recvs=[(message, peer)], axis=AXIS)
        return TensorMeta.decode(message)

    def _chain(self, inputs: Inputs, with_data: bool) -> tuple[torch.Tensor | None, dict[int, TensorMeta]]:
        """The stages one after another (no grad): each receives its input's metadata (and, ``with_data``, the
        tensor; else it runs on zeros), runs, and passes its output on; a neighbour on this rank (a V's stages
        p - 1 and p) takes it directly. Returns the last stage's output (on its rank) and the metadata of every
        local stage's input (key s - 1) and output (key s)."""
        metas: dict[int, TensorMeta] = {}
        output: torch.Tensor | None = None
        local: dict[int, torch.Tensor] = {}  # an output whose next stage is on this rank
        tokens, positions = split(inputs)
        with torch.no_grad():
            for s in sorted(self.stages):
                if s == 0:
                    x = tokens
                elif s in local:
                    x = local.pop(s)
                    if not with_data:
                        x = torch.zeros_like(x)
                else:
                    metas[s - 1] = self._recv_meta(self._peer(s - 1))
                    x = metas[s - 1].empty(self.device)
                    if with_data:
                        self.comm.send_recv(recvs=[(x, self._peer(s - 1))], axis=AXIS)
                    else:
                        x.zero_()
                with self.precision.autocast(), self.param_scope(s, Kind.FORWARD):
                    out = self.stages[s].run(x, positions)
                if not isinstance(out, torch.Tensor):
                    raise TypeError(
                        f"pipeline stage {s} returned {type(out).__name__}; stages must pass one tensor. "
                        f"Fix: make each chunk's forward return a single tensor."
                    )
                metas[s] = TensorMeta.of(out)
                if s + 1 in self.stages:
                    local[s + 1] = out
                elif s + 1 < self.num_stages:
                    self._send_meta_and(out if with_data else None, metas[s], self._peer(s + 1))
                else:
                    output = out
        return output, metas

    def _shapes(self, inputs: Inputs) -> dict[int, TensorMeta]:
        tokens = tokens_of(inputs)
        key = (tuple(tokens.shape), tokens.dtype)
        if key not in self._metas:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices), self._mode(False):
                _, self._metas[key] = self._chain(inputs, with_data=False)
            logger.debug("pipeline shape pass for input %s: %s", key, self._metas[key])
        return self._metas[key]

    # ----------------------------------------------------------------- tied weights
    def _tied_copies(self) -> list[tuple[torch.nn.Module, str]]:
        """(module, attribute) of each tied parameter on the first stage (the owner) or of its copy, a buffer, on
        the last stage (``split.tie_copy``); the copies are made trainable leaves here, after the move to the
        device. Empty on the other ranks and without tied weights."""
        ends = [self.stages[s] for s in (0, self.num_stages - 1) if s in self.stages]
        if len(ends) != 1:  # a middle rank, or both ends here (nothing is copied then)
            return []
        stage = ends[0]
        found = []
        for first_name, last_name in stage.tied:
            path, _, attr = (first_name if stage.is_first else last_name).rpartition(".")
            module = stage.module.get_submodule(path)
            if stage.is_last:
                getattr(module, attr).requires_grad_(True)
            found.append((module, attr))
        return found

    def _sync_tied_weights(self) -> None:
        """Before a step or an evaluation: the last stage's copies take the first stage's values."""
        if not self.tied:
            return
        tensors = [getattr(module, attr).detach() for module, attr in self.tied]
        if 0 in self.stages:
            self.comm.send_recv(sends=[(t, self._peer(self.num_stages - 1)) for t in tensors], axis=AXIS)
        else:
            self.comm.send_recv(recvs=[(t, self._peer(0)) for t in tensors], axis=AXIS)

    def _sync_tied_grads(self) -> None:
        """After the step's backward passes: the copies' gradients are added to the owners' (and cleared), so
        the owner's gradient is the sum over both uses, as on one device."""
        if not self.tied:
            return
        tensors = [getattr(module, attr) for module, attr in self.tied]
        if 0 in self.stages:
            received = [torch.zeros_like(t) for t in tensors]
            self.comm.send_recv(recvs=[(g, self._peer(self.num_stages - 1)) for g in received], axis=AXIS)
            for param, grad in zip(tensors, received):
                param.grad = grad if param.grad is None else param.grad.add_(grad)
        else:
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]
            self.comm.send_recv(sends=[(g, self._peer(0)) for g in grads], axis=AXIS)
            for t in tensors:
                t.grad = None

    # ----------------------------------------------------------------- training
    def run(self, micro: Sequence[Micro], update: UpdateFn, loss: StepLoss) -> torch.Tensor:
        """``StepRunner.run``: the step under the strategy's ``no_sync`` (the Engine's update reduces the
        gradients once); a tracer that records gets the runtime's own per-action timeline."""
        self.loss = loss
        with self.no_sync():
            total = self.train_step(micro)
        self._trace()
        return total

    def update_window(self, microbatches: int) -> int:
        return microbatches

    def _trace(self) -> None:
        if self.comm.tracer is not None:
            self.comm.tracer.pipeline(self.timeline)

    def staleness(self) -> dict[int, dict[str, float]] | None:
        return None

    def train_step(self, micro: Sequence[Micro]) -> torch.Tensor:
        """Forward and backward of every micro-batch as the schedule says; returns the sum of the micro-batches'
        loss values (``StepLoss.value``, on every rank).
        Gradients accumulate in the stages' ``.grad`` (the caller syncs them over dp and steps)."""
        m = len(micro)
        if m != self.schedule.m:
            raise ScheduleError(f"the schedule runs m={self.schedule.m} micro-batches, but {m} were given.")
        for check in self.input_checks:
            check(tokens_of(micro[0][0]))
        self._sync_tied_weights()
        metas = self._shapes(micro[0][0])
        loss_sum = torch.zeros((), device=self.device)
        inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]] = {}
        outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        sends: list[tuple[Pending, list[torch.Tensor]]] = []
        self.timeline = []
        self.step_start = time.perf_counter()
        with self._mode(True):
            program, i = self.program, 0
            while i < len(program):
                action = program[i]
                i += 1
                if isinstance(action, tuple):
                    sends += self._post(action, metas, inbox, outbox)
                    continue
                if self.sends_before_compute:
                    self._finish_sends(sends)
                paired = self._pair_of(i - 1, inbox) if self.overlap_pairs else None
                if paired is not None:  # DualPipeV's overlapped pair: both chunks at once (overlap.py)
                    backward, i, between = paired
                    self._run_pair(action, backward, micro, inbox, outbox, loss_sum)
                    if between is not None:  # the forward's sends (and receives posted ahead), after the pair
                        sends += self._post(between, metas, inbox, outbox)
                    continue
                self._before_compute(action)
                self._wait_for_input(action, inbox)  # outside the timed span: waiting is not busy time
                started = time.perf_counter()
                with self.param_scope(action.stage, action.kind):
                    self._compute(action, micro, inbox, outbox, loss_sum)
                self.timeline.append((action, started, time.perf_counter()))
            self._after_actions()
            for pending, _tensors in sends:
                pending.wait()
        self.step_end = time.perf_counter()
        self._sync_tied_grads()
        if inbox or outbox:  # pragma: no cover - check_schedule guarantees every transfer is matched
            raise ScheduleError(f"pipeline step ended with unmatched transfers: {sorted(inbox) + sorted(outbox)}")
        self.comm.broadcast(loss_sum, AXIS, src=self.last_rank_index)
        return loss_sum

    def _pair_of(
        self, index: int, inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]]
    ) -> tuple[Action, int, Post | None] | None:
        """The backward that runs overlapped with the forward at ``program[index]``, where the program goes on
        after the pair, and the post between the two (the forward's sends and receives posted ahead: posted after
        the pair); None where the forward runs alone. A pair is a forward followed by a full backward of another
        stage whose input (an output gradient, unless its stage is the last) is already posted or handed over:
        decided by the program, never by timing, so every peer fuses the same pairs. Posting the forward's sends
        after the backward is the dependency rule of the pair swapped, which the simulator proves deadlock-free
        for DualPipeV (``tests/test_pipeline_overlap.py``)."""
        forward = self.program[index]
        if not isinstance(forward, Action) or forward.kind != Kind.FORWARD:
            return None
        after, between = index + 1, None
        if after < len(self.program):
            item = self.program[after]
            if isinstance(item, tuple):
                between, after = item, after + 1
        if after >= len(self.program):
            return None
        backward = self.program[after]
        if not isinstance(backward, Action) or backward.kind != Kind.BACKWARD or backward.stage == forward.stage:
            return None
        needs_grad = backward.stage != self.num_stages - 1
        if needs_grad and (Kind.BACKWARD, backward.stage, backward.microbatch) not in inbox:
            return None
        return backward, after + 1, between

    def _run_pair(
        self,
        forward: Action,
        backward: Action,
        micro: Sequence[Micro],
        inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]],
        outbox: dict[tuple[str, int, int], torch.Tensor],
        loss_sum: torch.Tensor,
    ) -> None:
        """``forward`` and ``backward`` overlapped (``overlap.run_pair``): both inputs waited for first, the
        forward on this thread, the backward on a helper, switching at each ep exchange. Each action's timeline
        entry spans its first to its last operation, so the two overlap there."""
        for action in (forward, backward):
            self._before_compute(action)
            self._wait_for_input(action, inbox)
        spans: dict[Action, float] = {}

        def run(action: Action) -> Callable[[], None]:
            def go() -> None:
                spans[action] = time.perf_counter()
                with self.param_scope(action.stage, action.kind):
                    self._compute(action, micro, inbox, outbox, loss_sum)
                self.timeline.append((action, spans[action], time.perf_counter()))

            return go

        def install(hook: Callable[[], None] | None) -> None:
            self.comm.overlap = hook

        run_pair(run(forward), run(backward), install)

    def _step_loss(self) -> StepLoss:
        if self.loss is None:
            raise ScheduleError("PipelineRunner.train_step runs inside run(), which gives it the step's loss")
        return self.loss

    @staticmethod
    def _finish_sends(sends: list[tuple[Pending, list[torch.Tensor]]]) -> None:
        """Complete the send batches posted since the last compute (``sends`` is emptied), before the next compute
        (schedules in ``SENDS_BEFORE_COMPUTE``).

        Where the transport moves bytes on a host thread (gloo), a send left running competes with the next
        compute for the core and reaches its peer later; 1F1B's steady state puts every hand-over on the critical
        path. Measured on the ``pp`` suite (2 CPU cores, gloo, 8 rounds), before receives were posted ahead: 1F1B
        at pp=2 went from 0.94 x torch's step rate to 0.99-1.02 x; the same wait cost GPipe at pp=4 about 4 % and
        interleaved about 1 point of bubble (docs/pipeline.md), so the others leave their sends running, as torch
        does. With receives posted ahead it costs little either way (1F1B at pp=2: 0.986 x with, 0.989 x without). On NCCL a wait only
        orders streams. Safe: the lowering lets every rank finish even if each send blocked until its receive
        was posted (``lower``)."""
        for pending, _tensors in sends:
            pending.wait()
        sends.clear()

    def _before_compute(self, action: Action) -> None:
        """Hook: runs before each compute action, after the comm runs before it were posted (nothing here)."""

    def _after_actions(self) -> None:
        """Hook: runs after the rank's last action, before the step's sends are waited for (nothing here)."""

    def _post(
        self,
        post: Post,
        metas: dict[int, TensorMeta],
        inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]],
        outbox: dict[tuple[str, int, int], torch.Tensor],
    ) -> list[tuple[Pending, list[torch.Tensor]]]:
        """Post the batches of ``post`` with one asynchronous ``Comm.send_recv_batches``; each received tensor waits
        in ``inbox`` with its own batch's ``Pending``. Returns the batches that send (their pending, tensors)."""
        batches: list[tuple[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]]] = []
        keys: list[list[tuple[str, int, int]]] = []
        for run in post:
            to_send: list[tuple[torch.Tensor, int]] = []
            to_recv: list[tuple[torch.Tensor, int]] = []
            batch_keys: list[tuple[str, int, int]] = []
            for a in run:
                s, j = a.stage, a.microbatch
                if a.kind == Kind.SEND_FORWARD:
                    to_send.append((outbox.pop((Kind.FORWARD, s, j)), self._peer(s + 1)))
                    if self.tags_activations:
                        to_send.append((outbox.pop(("V", s, j)), self._peer(s + 1)))
                elif a.kind == Kind.SEND_BACKWARD:
                    to_send.append((outbox.pop((Kind.BACKWARD, s, j)), self._peer(s - 1)))
                elif a.kind == Kind.RECV_FORWARD:
                    to_recv.append((metas[s - 1].empty(self.device), self._peer(s - 1)))
                    batch_keys.append((Kind.FORWARD, s, j))
                    if self.tags_activations:
                        to_recv.append((torch.empty(1, dtype=torch.int64, device=self.device), self._peer(s - 1)))
                        batch_keys.append(("V", s, j))
                else:  # RB: the gradient of this stage's output
                    to_recv.append((metas[s].empty(self.device), self._peer(s + 1)))
                    batch_keys.append((Kind.BACKWARD, s, j))
            batches.append((to_send, to_recv))
            keys.append(batch_keys)
        pendings = self.comm.send_recv_batches(batches, axis=AXIS)
        sending = []
        for pending, (to_send, to_recv), batch_keys in zip(pendings, batches, keys):
            pending.is_async = True
            for key, (buffer, _peer) in zip(batch_keys, to_recv):
                inbox[key] = (buffer, pending)
            if to_send:
                sending.append((pending, [tensor for tensor, _peer in to_send]))
        return sending

    def _wait_for_input(
        self, action: Action, inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]]
    ) -> None:
        """Wait for the batch that carries what ``action`` consumes (a received input or output gradient)."""
        key = (Kind.FORWARD if action.kind == Kind.FORWARD else Kind.BACKWARD, action.stage, action.microbatch)
        tensor, pending = inbox.get(key, (None, None))
        if tensor is not None and pending is not None:
            pending.wait()
            inbox[key] = (tensor, None)

    def _take(
        self, inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]], key: tuple[str, int, int]
    ) -> torch.Tensor:
        if key not in inbox:
            raise ScheduleError(
                f"action {key[1]}{key[0]}{key[2]} needs a tensor that was never received or handed "
                f"over: the lowered schedule is missing its recv."
            )
        tensor, pending = inbox.pop(key)
        if pending is not None:
            pending.wait()
        return tensor

    def _hand_over(
        self,
        kind: str,
        stage: int,
        microbatch: int,
        tensor: torch.Tensor,
        inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]],
        outbox: dict[tuple[str, int, int], torch.Tensor],
    ) -> None:
        """Queue a stage's output ("F") or input gradient ("B") for its neighbour: directly when the neighbour
        is on this rank (p = 1, or stages p - 1 and p of a V), else for the send action that follows."""
        neighbour = stage + 1 if kind == Kind.FORWARD else stage - 1
        if neighbour in self.stages:
            inbox[(kind, neighbour, microbatch)] = (tensor, None)
        else:
            outbox[(kind, stage, microbatch)] = tensor.contiguous()

    def _compute(
        self,
        action: Action,
        micro: Sequence[Micro],
        inbox: dict[tuple[str, int, int], tuple[torch.Tensor, Pending | None]],
        outbox: dict[tuple[str, int, int], torch.Tensor],
        loss_sum: torch.Tensor,
    ) -> None:
        s, j, kind = action.stage, action.microbatch, action.kind
        stage = self.stages[s]
        if kind == Kind.FORWARD:
            tokens, positions = split(micro[j][0])
            x = tokens if s == 0 else self._take(inbox, (Kind.FORWARD, s, j))
            loss = self._step_loss()
            with self.precision.autocast():
                out = stage.forward(j, x, positions)
                if stage.is_last:
                    value = loss.value(out, micro[j][1])
            if stage.is_last:
                stage.set_loss(j, self.precision.scale(loss.to_backward(j, value)))
                loss_sum += value.detach().float()
            else:
                self._hand_over(Kind.FORWARD, s, j, out.detach(), inbox, outbox)
        elif kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT):
            grad = None if stage.is_last else self._take(inbox, (Kind.BACKWARD, s, j))
            grad_input = stage.backward(j, grad) if kind == Kind.BACKWARD else stage.backward_input(j, grad)
            if not stage.is_first:
                if grad_input is None:  # an input without a gradient (e.g. integers): send zeros like it
                    grad_input = self._shapes(micro[0][0])[s - 1].empty(self.device).zero_()
                self._hand_over(Kind.BACKWARD, s, j, grad_input, inbox, outbox)
        else:  # W
            stage.backward_weight(j)

    # ----------------------------------------------------------------- evaluation
    def forward(self, inputs: Inputs, training: bool = False) -> torch.Tensor | None:
        """Forward-only pass of the whole batch through the stages (no grad; eval mode unless ``training``);
        returns the last stage's output on the rank holding it, None elsewhere."""
        for check in self.input_checks:
            check(tokens_of(inputs))
        self._sync_tied_weights()
        with self._mode(training):
            output, _ = self._chain(inputs, with_data=True)
        return output

    def count_activations(self, on: bool = True) -> None:
        """Count the activation bytes each local stage holds from now on (``peak_activation_bytes``): off by
        default, since counting hooks every tensor autograd saves (a host cost per forward action)."""
        for stage in self.stages.values():
            stage.count_activations = on

    def peak_activation_bytes(self) -> dict[int, int]:
        """Per local stage: the most activation bytes it held at once while counting (``count_activations``)."""
        if not all(stage.count_activations for stage in self.stages.values()):
            raise ScheduleError(
                "peak_activation_bytes: activation bytes are counted only once asked for. Fix: call "
                "engine.pipeline.count_activations() before the steps to measure."
            )
        return {s: stage.peak_bytes for s, stage in self.stages.items()}


__all__ = ["PipelineRunner", "TensorMeta", "check_schedule"]
